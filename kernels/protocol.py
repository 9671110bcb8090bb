"""The one small protocol every implementation under test sits behind."""

from __future__ import annotations

import re
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kda_cases.case import Case
from kda_cases.envelope import ANY, Envelope
from kda_cases.materialize import KDAInputs
from kda_reference.chunked import DEFAULT_CHUNK
from kda_reference.gradients import Gradients


@dataclass(frozen=True)
class Support:
    """A yes, or a no with the reason a person can act on."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> Support:
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> Support:
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.ok


def relayout(state: torch.Tensor, v_first: bool, to_v_first: bool) -> torch.Tensor:
    """A state (``[..., K, V]``, or ``[..., V, K]`` when ``v_first``) in the other layout where they differ: an
    adapter's conversion between the case's layout and the one its kernel keeps."""
    return state if v_first == to_v_first else state.transpose(-1, -2)


@dataclass(frozen=True)
class LibraryTolerance:
    """The tolerance a library's own tests assert on its kernel, with the file they are in: what its
    maintainers accept. Every record of its backends carries its ratio to it beside the suite's limits, and
    every finding says whether it is beyond it (reports/findings.py ``Finding.tier``). The metric is the
    suite's rel-RMS (RMS of the error over RMS of the reference), the one FLA's ``get_err_ratio`` and AITER's
    relative L2 norm compute; their references are float32 loops, the suite's float64."""

    rel_rms: float
    tensors: tuple[str, ...]  # the tensors the library's tests hold to it ("o", "final_state")
    source: str  # the test file and the assertion

    def __post_init__(self) -> None:
        if not (isinstance(self.rel_rms, int | float) and self.rel_rms > 0):
            raise ValueError(f"LibraryTolerance.rel_rms must be a positive number, got {self.rel_rms!r}")
        unknown = [t for t in self.tensors if t not in ("o", "final_state", "checkpoint_states")]
        if not self.tensors or unknown:
            raise ValueError(f"LibraryTolerance.tensors {self.tensors!r}: name o, final_state or checkpoint_states")
        if not self.source.strip():
            raise ValueError("LibraryTolerance.source must cite the test that asserts it")

    def limit(self, tensor: str) -> float:
        """Its rel-RMS limit on ``tensor`` (NaN where its tests do not hold that tensor)."""
        return self.rel_rms if tensor in self.tensors else float("nan")


@dataclass(frozen=True)
class Library:
    """The library a backend's kernel comes from, declared once: the run's environment records its version
    (or its source tree's commit), every record names it, the findings page's kernel column and a standalone
    file's skip reason come from it."""

    name: str  # as people call it: "fla-core", "AITER", "FlashKDA", "vLLM", "SGLang"
    distribution: str = ""  # its installed distribution (importlib.metadata), where it may be installed
    source_variable: str = ""  # the KDA_*_SRC variable that names its source tree, where it may run from one
    module: str = ""  # its import name (a standalone file imports it, or skips naming what is missing)
    install: str = ""  # how to get it
    tolerance: LibraryTolerance | None = None  # what its own tests assert (None: not established)


# Where a declared design holds: the platform a kernel runs on (``platform_of``).
PLATFORMS = ("cpu", "nvidia", "amd")
# How a float32 matmul's operands enter it: exactly (``ieee``), rounded to TF32 (``tf32``: nearest, ties to
# even, as cuBLAS converts them), or cut to TF32 (``tf32-truncated``: the low 13 mantissa bits dropped, as
# Triton's ``tl.dot(input_precision="tf32")`` hands float32 registers to NVIDIA's tensor cores, which read
# the upper 19 bits: triton-lang/triton#4574).
DOT_PRECISIONS = ("ieee", "tf32", "tf32-truncated")


def platform_of(device: torch.device) -> str:
    """``cpu``, ``nvidia`` or ``amd``: what a declared design's ``platforms`` name (ROCm's torch calls its GPUs
    ``cuda`` too)."""
    if device.type != "cuda":
        return "cpu"
    return "amd" if torch.version.hip is not None else "nvidia"


@dataclass(frozen=True)
class WorkingPrecision:
    """Where a kernel computes below the case's precision by a design its library states, declared with the document,
    file or PR that states it: its recurrent state kept in ``state_dtype`` between updates, one update per ``chunk``
    tokens (FlashKDA: bf16, 16), and its float32 matmuls' operands rounded to ``dots`` (``tf32-truncated``: FLA's
    and SGLang's Triton chunk kernels on NVIDIA GPUs; ``DOT_PRECISIONS``). Its budgets then come from the baseline
    run at that precision, and every record keeps its ratio to the strict baseline's limits beside it
    (docs/tolerance.md): the design's cost, shown apart from the findings. It holds on ``platforms`` (empty: every
    one) and for the library ``versions`` its source was read in (empty: any; on another version the backend is
    judged strictly until someone reads the new source). A declaration is never a way to retire a finding: what a
    kernel's users do not expect stays in the ledger."""

    state_dtype: str | None = None
    chunk: int = DEFAULT_CHUNK
    source: str = ""  # the document that states the design: project, file and line, section or PR
    dots: str = "ieee"
    platforms: tuple[str, ...] = ()
    versions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.state_dtype not in (None, "bf16", "fp16"):
            raise ValueError(
                f"WorkingPrecision.state_dtype {self.state_dtype!r} not allowed; choose bf16, fp16 or None"
            )
        if not (isinstance(self.chunk, int) and self.chunk >= 1):
            raise ValueError(f"WorkingPrecision.chunk must be a positive number of tokens, got {self.chunk!r}")
        if self.dots not in DOT_PRECISIONS:
            raise ValueError(f"WorkingPrecision.dots {self.dots!r} not allowed; choose {' or '.join(DOT_PRECISIONS)}")
        if self.state_dtype is None and self.dots == "ieee" and self.chunk <= DEFAULT_CHUNK:
            raise ValueError(
                f"WorkingPrecision declares nothing: give a state_dtype, TF32 dots, a chunk above {DEFAULT_CHUNK}"
                " tokens, or several"
            )
        unknown = [p for p in self.platforms if p not in PLATFORMS]
        if unknown:
            raise ValueError(f"WorkingPrecision.platforms {unknown} not allowed; choose from {', '.join(PLATFORMS)}")
        if not self.source.strip():
            raise ValueError("WorkingPrecision.source must cite the document that states the design")

    @classmethod
    def tf32_on_nvidia(cls, source: str, version: str) -> WorkingPrecision:
        """The design FLA's chunk kernels and their copies state: float32 matmuls in TF32 on NVIDIA GPUs (the
        intra-chunk inverse's by a hard-coded precision, the rest at Triton's default), read in ``version``.
        Triton's TF32 dots cut their float32 operands rather than round them (``DOT_PRECISIONS``), so the
        design's baseline cuts them too: on an H200 the FLA chunk kernels' fp32 error was about twice a
        nearest-rounded TF32 baseline's (docs/tolerance.md)."""
        return cls(dots="tf32-truncated", source=source, platforms=("nvidia",), versions=(version,))

    @classmethod
    def chunked(cls, chunk: int, source: str) -> WorkingPrecision:
        """A kernel's float32 work over chunks of ``chunk`` tokens, more than the baseline's (``DEFAULT_CHUNK``):
        its triangular solve and its sums over a chunk round over more terms. On the CPU the baseline's own
        algebra at chunk 128 erred 2.4 to 7.8 times as much as at 64 in fp32 final states (T130 lb-5, six seeds:
        docs/tolerance.md), so it is held to what its chunk costs the baseline, not what 64 tokens cost."""
        return cls(chunk=chunk, source=source)

    @property
    def label(self) -> str:
        parts = [f"{self.state_dtype} state every {self.chunk} tokens"] if self.state_dtype else []
        if not self.state_dtype and self.chunk != DEFAULT_CHUNK:
            parts.append(f"{self.chunk}-token chunks")
        return ", ".join([*([f"{self.dots} dots"] if self.dots != "ieee" else []), *parts])

    @property
    def unit_roundoff(self) -> float:
        """The coarsest rounding the design adds (TF32's 2^-11, a bf16 state's 2^-8): part of the working
        precision a budget's cap is taken from."""
        units = {"bf16": 2.0**-8, "fp16": 2.0**-11, "tf32": 2.0**-11, "tf32-truncated": 2.0**-10}
        return max(
            units[self.state_dtype] if self.state_dtype else 0.0, units[self.dots] if self.dots != "ieee" else 0.0
        )

    def holds_on(self, device: torch.device, version: str = "") -> bool:
        """Whether the design holds for a run on ``device`` with the library at ``version`` (as the run records
        it: ``0.6.0``, or ``vllm 0.33.0 (KDA_VLLM_SRC)`` for a source tree): on a listed platform, and a listed
        version (a word of ``version``, a commit matching at any length from 7 hex digits)."""
        if self.platforms and platform_of(device) not in self.platforms:
            return False
        words = version.split()
        return not self.versions or any(_same_version(wanted, word) for wanted in self.versions for word in words)


def _same_version(declared: str, recorded: str) -> bool:
    """Whether a recorded version word is the declared one: equal, or one git commit written at two lengths
    (a source tree's COMMIT file holds the full hash where the declaration cites ``e4048607a5``)."""
    if declared == recorded:
        return True
    shorter, longer = sorted((declared.lower(), recorded.lower()), key=len)
    return len(shorter) >= 7 and _HEX.fullmatch(longer) is not None and longer.startswith(shorter)


_HEX = re.compile(r"[0-9a-f]{7,40}")


@dataclass(frozen=True)
class BackendOutput:
    """What a backend computed, as it returned it (its own dtypes, the case's state layout).

    ``checkpoint_states`` is None when the backend cannot produce states at the
    case's checkpoints.
    """

    o: torch.Tensor
    final_state: torch.Tensor | None
    checkpoint_states: torch.Tensor | None = None
    # True where ``o`` was read from a buffer the caller gave the kernel, filled with CALLER_BUFFER_FILL
    # before the call: a row the kernel leaves unwritten is then the caller's, not the kernel's garbage.
    o_in_caller_buffer: bool = False


# What the suite fills an output buffer with that a backend's API writes into: a server hands its layer's
# torch.empty buffer (stale memory), and NaN shows a row the kernel leaves unwritten the same way every run.
CALLER_BUFFER_FILL = float("nan")


class Unsupported(Exception):
    """Raised by ``run`` for a case outside the backend's envelope; carries the reason."""


class Backend(ABC):
    """An implementation under test.

    ``availability`` says whether it can run in this environment at all (package
    installed, device present); ``envelope`` which cases it takes, as data (``supports`` and ``fit`` follow
    from it, and the cases drawn for it are drawn inside it); ``run`` computes a case. Neither question may
    raise or crash: both answer with a reason.
    """

    name: str = ""
    description: str = ""
    # What it takes (cases/envelope.py). The default takes every case.
    envelope: Envelope = ANY
    # Where it computes below the case's precision by its documented design (None: nowhere).
    working_precision: WorkingPrecision | None = None
    # The code lineage its kernel belongs to ("FLA chunk (Triton)": FLA's chunk kernels and every copy of them):
    # untriaged failures of one case group by it, so one algorithm failing alike in four copies reads as one
    # finding ("": its own name).
    family: str = ""
    # The libraries its kernel comes from (FLA's dispatch to FlashKDA: both); empty for the suite's own. The
    # first that states a tolerance of its own tests is the one its records are held to beside the suite's.
    libraries: tuple[Library, ...] = ()
    # Whether ``run`` returns the states at the case's checkpoints (prefix caching); the serving harness
    # plans checkpoint slots only for backends that do.
    produces_checkpoints: bool = False
    # The largest block of tokens the backend computes together (its chunk; 1 for a token-serial kernel).
    # Changing a token may move earlier outputs of its own block by rounding (not batch-invariant), never
    # those of earlier blocks (that is a causal leak): the prefix check tells the two apart by it.
    chunk_tokens: int = 64
    # What makes its float32 dots IEEE, set before anything compiles (``kda-conformance triage``'s IEEE switch):
    # Triton's default precision unless a library has a switch of its own.
    ieee_switch: dict[str, str] = {"TRITON_F32_DEFAULT": "ieee"}  # noqa: RUF012 (read, never written)
    # Registered backends that are this kernel at another chunk size (triage's chunk-size switch).
    chunk_variants: tuple[str, ...] = ()
    # The environment variables ``run`` (or the library it imports) sets on purpose; a change to any other is
    # put back after the call and is the backend's failure (kernels/world.py). Never a ``KDA_*`` variable.
    sets_environment: tuple[str, ...] = ()

    def scratch_bytes_per_token(self, case: Case) -> int:
        """Device memory its forward call allocates per token of ``case``'s shape beyond its inputs, its output and
        a float32 state per 64 tokens (what every chunk kernel keeps), in bytes: the memory plans of batches of
        millions of tokens (offsets past 2^31) read it. 0 where nothing more is known."""
        return 0

    @property
    def library_tolerance(self) -> LibraryTolerance | None:
        """The tolerance the first of its libraries that states one asserts in its own tests."""
        return next((lib.tolerance for lib in self.libraries if lib.tolerance is not None), None)

    @abstractmethod
    def availability(self, device: torch.device) -> Support:
        """Whether this backend can run on ``device`` in this environment."""

    def supports(self, case: Case) -> Support:
        """Whether this backend takes ``case``, and if not, why: its envelope first (the reason names the
        field), then ``also_supports`` for what the record cannot say."""
        refusal = self.envelope.refusal(case)
        if refusal is not None:
            return Support.no(f"{self.name} {refusal}")
        return self.also_supports(case)

    def also_supports(self, case: Case) -> Support:
        """What the envelope cannot say (a choice of the installed library, a coupling of two fields); yes by
        default. A backend that refuses here gives ``fit`` a way in too, or its drawn cases are filtered."""
        return Support.yes()

    def fit(self, case: Case) -> Case:
        """``case`` moved into this backend's envelope where a few fields keep it out (a kernel that takes
        only K = V = 128, say), every other axis kept: what a fixed case (the first sweep's, a long case's, the
        checks table's) becomes for a narrow backend. Drawn cases are drawn inside the envelope already."""
        return self.envelope.fit(case)

    def markers(self, device: torch.device) -> tuple[str, ...]:
        """pytest markers this backend's tests carry on ``device`` (AITER on a gfx950: ``gfx950``), so CI
        selects them with ``-m``; derived from backend and device, never written on each test."""
        return ()

    def interpreted(self, device: torch.device) -> bool:
        """Whether this backend runs interpreted on ``device`` (Triton kernels on a CPU): seconds per call,
        so the CPU tiers give it only their shortest corpus cases."""
        return False

    # A correct control: `kda-conformance detection` expects it to pass (a plugin's backends are otherwise
    # taken for planted bugs, which must be caught).
    correct_control: bool = False

    # Optional capabilities, None where the backend has none; a backend that has one defines the method.
    # ``run_paged(batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None``: an in-place
    # paged API, as a server calls it (kernels/serving.py documents the arguments); the serving checks call it
    # instead of gathering and scattering around ``run``.
    run_paged: Callable[..., None] | None = None
    # The sentinels ``run_paged`` takes in ``state_indices`` for padding entries: -1 (SGLang's PAD_SLOT_ID), 0
    # (vLLM's NULL_BLOCK_ID, the null slot), or both; the serving harness hands each case one of them. The
    # gather path for backends without ``run_paged`` drops padding entries itself, as vLLM's glue does.
    pad_slot_ids: tuple[int, ...] = (-1, 0)
    # ``run_backward(inputs, d_o, d_final) -> Gradients`` (reference/gradients.py): the gradients of
    # ``sum(o * d_o) + sum(final_state * d_final)`` with respect to every input of the call, in the inputs' dtypes
    # and layouts, where ``envelope.backward`` declares a backward pass (the gradient check calls it).
    run_backward: Callable[..., Gradients] | None = None
    # ``standalone_source(case) -> str``: the source of a ``call(q, k, v, g, beta, initial_state, cu_seqlens,
    # **kwargs)`` that needs only torch and the backend's own package, for `repro --write-test`.
    standalone_source: Callable[[Case], str] | None = None
    # Modules of the suite that ``standalone_source``'s call uses and a standalone file carries verbatim before
    # it: each imports nothing of the suite (kernels/server_stubs.py, kernels/server_layers.py).
    standalone_modules: tuple[types.ModuleType, ...] = ()

    def host_metadata(self, device: torch.device, cu_seqlens_cpu: torch.Tensor) -> dict[str, torch.Tensor]:
        """The host metadata for a batch with these ``cu_seqlens`` (on the CPU), built as a server builds it
        (no device-to-host sync per call), keyed by argument name; empty where the installed library's API
        takes none (found from its signature). ``run`` passes on what ``inputs.host_metadata`` holds."""
        return {}

    @abstractmethod
    def run(self, inputs: KDAInputs) -> BackendOutput:
        """Run on the inputs (already on the device). Raise Unsupported for cases outside the envelope."""

    def __repr__(self) -> str:
        return f"<backend {self.name}>"
