"""Seeded inputs for a Case: drawn on the CPU from the seed, then moved, so one id means one set of bits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from kda_cases import seeded
from kda_cases.case import Case
from kda_cases.guards import guarded


@dataclass(frozen=True)
class KDAOptions:
    """Everything a KDA call takes besides ``q k v g beta``, in chunk_kda's terms, as one typed object.

    The reference's forms take it whole; :meth:`kernel_kwargs` spells it as chunk_kda's keywords.
    ``checkpoints`` lists ``(sequence, tokens)`` pairs: the state of that sequence after its first
    ``tokens`` tokens (a reference output; kernels have no such argument).
    """

    scale: float | None = None
    initial_state: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | Sequence[int] | None = None
    use_qk_l2norm_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    lower_bound: float | None = None
    state_v_first: bool = False
    checkpoints: Sequence[tuple[int, int]] = ()

    def kernel_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of chunk_kda-style kernels (FLA's, AITER's): every field but the
        checkpoints, which are the reference's alone."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "checkpoints"}

    @classmethod
    def of(
        cls,
        case: Case,
        initial_state: Any = None,
        cu_seqlens: Any = None,
        A_log: Any = None,
        dt_bias: Any = None,
    ) -> KDAOptions:
        """The options ``case`` defines, its tensors as given: the one place a case's fields become chunk_kda's
        keywords (what a test file's callable is passed, and lacks, is read from it too)."""
        return cls(
            scale=case.scale,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=case.l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=case.beta_sigmoid_in_kernel,
            use_gate_in_kernel=case.gate_in_kernel,
            A_log=A_log,
            dt_bias=dt_bias,
            lower_bound=case.lower_bound,
            state_v_first=case.state_v_first,
            checkpoints=case.checkpoints,
        )


@dataclass(frozen=True)
class KDAInputs:
    """Everything a backend call needs, in the form chunk_kda takes it.

    ``q k v g beta`` are in the case's input dtype; ``g`` and ``beta`` are raw
    pre-activations when the case applies the gate or sigmoid in the kernel.
    ``initial_state`` is in the case's state dtype and layout.
    """

    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    # Sequence metadata built on the host and passed in, as servers do (``Backend.host_metadata``); None:
    # the kernel derives what it needs from ``cu_seqlens`` itself.
    host_metadata: Mapping[str, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def options(self) -> KDAOptions:
        """The call's options as the case defines them (the case's checkpoints included)."""
        return KDAOptions.of(self.case, self.initial_state, self.cu_seqlens, self.A_log, self.dt_bias)

    def kernel_kwargs(self) -> dict[str, Any]:
        """chunk_kda's keyword arguments for these inputs."""
        return self.options.kernel_kwargs()


def materialize(case: Case, device: str | torch.device = "cpu", drawn: KDAInputs | None = None) -> KDAInputs:
    """Draw the case's tensors on the CPU from its seed and move them to ``device`` in the case's layout
    (``drawn``: the case's ``drawn_on_cpu`` tensors, drawn ahead)."""
    if drawn is None:
        drawn = drawn_on_cpu(case)
    elif drawn.case != case:
        raise ValueError(f"drawn: tensors of case {drawn.case.id}, not of {case.id}")
    dev = torch.device(device)

    def move(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(dev)

    # Moved first, laid out after: a view of a fused buffer moved alone would arrive contiguous.
    tokens = laid_out(case.input_layout, *(getattr(drawn, name).to(dev) for name in ("q", "k", "v", "g", "beta")))
    rest = (move(drawn.A_log), move(drawn.dt_bias), move(drawn.initial_state), move(drawn.cu_seqlens))
    # Every input inside poisoned guard bands (cases/guards.py): a read past its end shows.
    q, k, v, g, beta, A_log, dt_bias, h0, cu = guarded(*tokens, *rest)
    assert q is not None and k is not None and v is not None and g is not None and beta is not None  # for mypy
    return KDAInputs(
        case=case, q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, cu_seqlens=cu
    )


def drawn_on_cpu(case: Case) -> KDAInputs:
    """The case's tensors drawn on the CPU from its seed, in their dtypes and contiguous (cases/seeded.py): the
    CPU work of ``materialize`` (seconds for a large case on one thread), which needs no device memory, so a run
    can do it before it takes its share of a GPU."""
    return KDAInputs(case=case, **seeded.draw(case))


def laid_out(layout: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``q k v g beta`` in the memory layout a server hands a kernel (cases/seeded.py ``laid_out``)."""
    return seeded.laid_out(layout, *tensors)


def cu_seqlens_tensor(
    case: Case, device: str | torch.device, padding: int = 0, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """``case.cu_seqlens(padding)`` as a tensor on ``device`` (int32, as servers pass it, unless asked)."""
    return torch.tensor(case.cu_seqlens(padding), dtype=dtype, device=device)
