"""AITER's package __init__ builds its HIP kernels; a Triton-only caller must never run it (the double fails
loudly where one does)."""

raise ImportError("aiter/__init__.py ran: the HIP JIT build a Triton-only import must not start")
