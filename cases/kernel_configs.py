"""Kernel configurations: the axes of a case that select which compiled kernels a backend runs.

Two cases of one configuration differ only in lengths, seeds and regimes, so a Triton backend compiles and
autotunes once for both (70 to 170 s on a fresh H200 for FLA's chunk path), and a configuration that crashed
the device once will crash it again. The night counts them, compiles them up front
(conformance/running/compile.py) and quarantines a configuration after a sticky device error
(reports/quarantine.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from kda_cases.case import Case

# The Case fields a kernel is specialised on (constexprs, autotune keys, in-kernel flags, layouts, packing).
KERNEL_FIELDS = (
    "num_heads",
    "num_v_heads",
    "head_k_dim",
    "head_v_dim",
    "dtype",
    "state_dtype",
    "gate",
    "lower_bound",
    "safe_gate",
    "l2norm_in_kernel",
    "beta_sigmoid_in_kernel",
    "state_layout",
    "packed",
)

KernelConfig = tuple[tuple[str, object], ...]


def kernel_config(case: Case) -> KernelConfig:
    """The kernel configuration of ``case``: its KERNEL_FIELDS and whether it has an initial state."""
    return (*((name, getattr(case, name)) for name in KERNEL_FIELDS), ("has_initial_state", case.has_initial_state))


def config_label(config: KernelConfig) -> str:
    """A short, stable text for a configuration (a quarantine's key, a compile job's name)."""
    values = dict(config)
    gate = values["gate"] if values["lower_bound"] is None else f"{values['gate']}{values['lower_bound']:g}"
    flags = "".join(
        flag
        for flag, on in (
            ("+l2", values["l2norm_in_kernel"]),
            ("+sig", values["beta_sigmoid_in_kernel"]),
            ("+safe", values["safe_gate"]),
            ("+varlen", values["packed"]),
            ("+h0", values["has_initial_state"]),
        )
        if on
    )
    return (
        f"H{values['num_heads']}/{values['num_v_heads']} K{values['head_k_dim']} V{values['head_v_dim']} "
        f"{values['dtype']} state-{values['state_dtype']} {values['state_layout']} {gate}{flags}"
    )


def distinct_configs(cases: Iterable[Case]) -> dict[KernelConfig, Case]:
    """Each distinct configuration of ``cases`` with the first case that has it, in order."""
    found: dict[KernelConfig, Case] = {}
    for case in cases:
        found.setdefault(kernel_config(case), case)
    return found


def warm_up_case(case: Case) -> Case:
    """A short case of ``case``'s configuration (a few chunks, the same heads, dims, flags, layout, packing and
    initial state): what the compile stage runs to build and tune its kernels before the night's cases."""
    if case.packed:
        lens = (70, 0, 33) if len(case.seq_lens) > 1 else (70,)
    else:
        lens = (70,) * min(2, len(case.seq_lens))
    return case.replace(seq_lens=lens, checkpoints=(), tags=("compile",))
