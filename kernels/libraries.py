"""The libraries the built-in backends' kernels come from, each declared once (kernels/protocol.py Library), with
the tolerance each one's own tests assert where it is established (what its maintainers accept)."""

from __future__ import annotations

from kda_kernels.protocol import Library, LibraryTolerance

FLA = Library(
    "fla-core",
    "fla-core",
    module="fla",
    install="pip install fla-core==0.6.0",
    tolerance=LibraryTolerance(
        0.005,
        ("o", "final_state"),
        "fla-org/flash-linear-attention tests/ops/test_kda.py test_chunk: assert_close('o', ...) and "
        "assert_close('ht', ...) at 0.005 against naive_recurrent_kda (float32); fla/utils/_testing.py get_err_ratio: "
        "RMS of the difference over RMS of the reference (with FLA_CI_ENV=1 a miss below 0.01, or with max-abs "
        "<= 0.3, only warns)",
    ),
)
AITER = Library(
    "AITER",
    "aiter",
    "KDA_AITER_SRC",
    "aiter",
    "ROCm/aiter, installed or as a source tree named by KDA_AITER_SRC",
    tolerance=LibraryTolerance(
        0.02,
        ("o",),
        "ROCm/aiter op_tests/triton_tests test_flash_kda.py: rel_err = ||a - b|| / ||b|| < 2e-2 against a float32 "
        "token recurrence and against the default pipeline",
    ),
)
FLASHKDA = Library(
    "FlashKDA",
    "flash_kda",
    module="flash_kda",
    install="MoonshotAI/FlashKDA, built from source (docs/flashkda.md)",
    tolerance=LibraryTolerance(
        0.005,
        ("o",),
        "MoonshotAI/FlashKDA tests/test_fwd.py test_fwd_vs_fla: FLA's assert_close on o at 0.005 against "
        "fused_recurrent_kda in float64 (the final state only warned)",
    ),
)
VLLM = Library(
    "vLLM",
    "vllm",
    "KDA_VLLM_SRC",
    install="vLLM's kernel folders, named by KDA_VLLM_SRC (docs/serving.md)",
    tolerance=LibraryTolerance(
        0.005,
        ("o",),
        "vllm-project/vllm tests/models/kimi_k3/test_kda.py: RMS of the difference over RMS of a float32 reference "
        "< 0.005, lengths up to 8192",
    ),
)
# SGLang: the tolerance of its own KDA tests is not established (docs/findings.md says so per finding).
SGLANG = Library(
    "SGLang", "sglang", "KDA_SGLANG_SRC", install="SGLang's kernel folders, named by KDA_SGLANG_SRC (docs/serving.md)"
)
