"""The libraries the built-in backends' kernels come from, each declared once (kernels/protocol.py Library)."""

from __future__ import annotations

from kda_kernels.protocol import Library

FLA = Library("fla-core", "fla-core", module="fla", install="pip install fla-core==0.6.0")
AITER = Library(
    "AITER", "aiter", "KDA_AITER_SRC", "aiter", "ROCm/aiter, installed or as a source tree named by KDA_AITER_SRC"
)
FLASHKDA = Library(
    "FlashKDA", "flash_kda", module="flash_kda", install="MoonshotAI/FlashKDA, built from source (docs/flashkda.md)"
)
VLLM = Library("vLLM", "vllm", "KDA_VLLM_SRC", install="vLLM's kernel folders, named by KDA_VLLM_SRC (docs/serving.md)")
SGLANG = Library(
    "SGLang", "sglang", "KDA_SGLANG_SRC", install="SGLang's kernel folders, named by KDA_SGLANG_SRC (docs/serving.md)"
)
