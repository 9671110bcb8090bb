from aiter.ops.triton.kimi_delta_attn.chunk_delta_attn import chunk_kimi_delta_attn  # noqa: F401
