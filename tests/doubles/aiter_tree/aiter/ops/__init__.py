raise ImportError("aiter/ops/__init__.py ran: the HIP JIT build a Triton-only import must not start")
