"""Named conventions for cases: a library's tests or a server's layer spelled as the Case fields they fix.

``Case``'s defaults are the servers' (the gate computed in the kernel from a raw projection, beta's sigmoid
and q/k's l2norm in the kernel). A kernel engineer porting FLA's tests writes FLA's instead: ``chunk_kda``'s
own defaults, a precomputed log gate, beta already through its sigmoid, q and k normalised outside. A preset
sets those fields at once (``preset("fla", seq_lens=(300,), dtype=torch.bfloat16)``), every other field as
given or the Case's default.
"""

from __future__ import annotations

from typing import Any

from kda_cases.case import Case

PRESETS: dict[str, dict[str, object]] = {
    # chunk_kda's defaults, as FLA's tests/ops/test_kda.py call it: g = logsigmoid(...) precomputed, beta =
    # sigmoid(...) precomputed, use_qk_l2norm_in_kernel=False, no lower bound (no safe gate without one).
    "fla": {
        "gate": "log",
        "lower_bound": None,
        "safe_gate": False,
        "beta_sigmoid_in_kernel": False,
        "l2norm_in_kernel": False,
    },
}


def preset(name: str, **fields: object) -> Case:
    """A Case in the conventions of ``name`` (one of :data:`PRESETS`), with ``fields`` over them."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    chosen: dict[str, Any] = {**PRESETS[name], **fields}
    return Case(**chosen)
