"""CUDA-graph replay: a batch served inside a captured CUDA graph with static buffers, then replayed with new
inputs and new sequence boundaries of the same shapes, equals the eager call on the same inputs bit for bit,
and each replay is within its own truth's budgets.

SGLang runs KDA prefill inside a CUDA graph: the host tables and ``cu_seqlens`` are rewritten in place before
every replay while the graph's buffers stay. A kernel that bakes a bound into the capture, or reads one on the
host, gives the first batch's answer on the second. The plan (:func:`plan`): warm the call up on the static
buffers (Triton compiles and tunes outside the capture), capture one call, then for the case's own batch and a
second batch (the same number of sequences and tokens, the boundaries moved, new inputs) copy its tensors into
the static buffers, ``cu_seqlens`` in place, and the sequence tables a server builds on the host for the
device (SGLang's graph prefill's chunk tables, :func:`device_tables`) in place too, replay, and compare. A
capture that raises (a host sync, an allocation the graph cannot hold) is the backend's failure where its
envelope says it can be captured (``graph_capture``), and is recorded as "not graph-safe" with what raised
otherwise. What the adapter itself computes on the host from the case (not from ``cu_seqlens``) is baked into
the capture as a server's layer code would be. On a GPU only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs, materialize
from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._derived import TOKEN_TENSORS
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.checks.determinism import largest_change
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import NotApplicable, call_backend
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth, inputs_truth
from kda_kernels.protocol import Backend, BackendOutput
from kda_reports.findings import Finding

NAME = "graph_replay"
# What the static buffers hold between replays: every tensor a call reads, rewritten in place.
STATIC = (*TOKEN_TENSORS, "A_log", "dt_bias", "initial_state", "cu_seqlens")


def moved_boundaries(case: Case) -> Case:
    """A second batch of the same shapes (as many sequences, as many tokens) whose boundaries are elsewhere,
    with new inputs: the lengths rotated by one, or, where that changes nothing, a token moved from the first
    sequence longer than one token to the next."""
    lengths = list(case.seq_lens[1:] + case.seq_lens[:1])
    if tuple(lengths) == case.seq_lens:
        giver = next((n for n, length in enumerate(lengths[:-1]) if length > 1), None)
        if giver is None:
            raise NotApplicable("no boundary can move: every sequence but the last holds one token or none")
        lengths[giver] -= 1
        lengths[giver + 1] += 1
    return case.replace(seq_lens=tuple(lengths), seed=case.seed + 1, checkpoints=(), tags=(*case.tags, "replayed"))


def plan(case: Case) -> dict[str, object]:
    """What the check captures, rewrites and compares for ``case`` (docs and tests read it)."""
    second = moved_boundaries(case)
    return {
        "captured": f"one call on static buffers shaped as {case.id} ({case.num_seqs} sequences, "
        f"{case.total_tokens} tokens), after a warm-up call on them",
        "rewritten": [*STATIC[:-1], "cu_seqlens (in place)", "the backend's device tables (in place)"],
        "replays": [case.seq_lens, second.seq_lens],
        "compared": "each replay bit for bit with the eager call on the same inputs, and with its own truth's budgets",
    }


def prepare(case: Case, backend: Backend) -> Case:
    """Packed (a graph is replayed with new boundaries), two sequences at least, a boundary that can move (the
    first sequence given a second token where every sequence but the last holds one or none), without
    checkpoints."""
    T = case.total_tokens
    lengths = list(case.seq_lens if case.num_seqs >= 2 else (max(1, T // 2), max(1, T - T // 2)))
    if lengths[1:] + lengths[:1] == lengths and all(length <= 1 for length in lengths[:-1]):
        lengths[0] = 2
    if case.packed and tuple(lengths) == case.seq_lens and not case.checkpoints:
        return case
    return case.replace(seq_lens=tuple(lengths), packed=True, checkpoints=())


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend, prepare)
    supported(backend, case)
    return Drawn(case)


def device_tables(backend: Backend, inputs: KDAInputs) -> dict[str, torch.Tensor]:
    """The sequence tables a server builds on the host for ``inputs``' batch and hands the kernel on the device
    (``Backend.host_metadata``: SGLang's graph prefill's chunk tables, sized by the batch's tokens and sequences,
    so a second batch of the same shapes fills the same buffers). Tables that stay on the host (FLA's
    ``cu_seqlens_cpu``) are not: a graph replays device work only, and what host code made of them at capture
    would be baked in."""
    if not backend.envelope.host_metadata:
        return {}
    made = backend.host_metadata(inputs.device, torch.tensor(inputs.case.offsets))
    return {name: table for name, table in made.items() if table.device == inputs.device}


def _copy_into(static: KDAInputs, inputs: KDAInputs, backend: Backend) -> None:
    for name in STATIC:
        target, source = getattr(static, name), getattr(inputs, name)
        if target is not None and source is not None:
            target.copy_(source)
    for name, table in device_tables(backend, inputs).items():  # the tables refilled before the replay
        static.host_metadata[name].copy_(table)  # type: ignore[index]


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    inputs = truth.inputs
    if inputs.device.type != "cuda":
        raise NotApplicable("CUDA graphs need a CUDA device")
    second_case = moved_boundaries(truth.case)
    second = materialize(second_case, inputs.device)
    batches = [(truth.case, inputs, truth, judge), (second_case, second, None, None)]
    clones = {name: getattr(inputs, name).clone() for name in STATIC if getattr(inputs, name) is not None}
    tables = {name: table.clone() for name, table in device_tables(backend, inputs).items()}
    static = dataclasses.replace(inputs, host_metadata=tables or None, **clones)
    declared = backend.envelope.graph_capture
    stream = torch.cuda.Stream(inputs.device)
    stream.wait_stream(torch.cuda.current_stream(inputs.device))
    # The backend's own run, not the guarded call: the guard hands a call copies of its inputs and compares
    # memory on the host, neither of which a graph can hold; the eager calls below are guarded as ever.
    try:
        with torch.cuda.stream(stream):  # the warm-up: compile and tune outside the capture
            backend.run(static)
        torch.cuda.current_stream(inputs.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = backend.run(static)
    except Exception as exc:  # the capture's own failure: a host sync, an allocation, a host-side cache
        said = f"capture raised {type(exc).__name__}: {str(exc)[:300]}"
        if declared:
            return [judge.problem("capture in a CUDA graph", f"declared graph-safe, but its {said}")]
        told = judge.passed("capture in a CUDA graph")
        return [dataclasses.replace(told, observed="not graph-safe", reason=said)]
    findings = []
    for n, (case, batch, batch_truth, batch_judge) in enumerate(batches):
        batch_truth = batch_truth or inputs_truth(batch, precision=truth.precision)
        batch_judge = batch_judge or Judge(NAME, case, backend.name, judge.device, judge.repro)
        _copy_into(static, batch, backend)
        graph.replay()
        torch.cuda.synchronize(inputs.device)
        replayed = BackendOutput(
            o=captured.o.clone(), final_state=None if captured.final_state is None else captured.final_state.clone()
        )
        eager = call_backend(backend, batch)
        label = f"replay {n + 1} (sequences {list(case.seq_lens)})"
        changes = {
            name: largest_change(getattr(replayed, name), getattr(eager, name))
            for name in ("o", "final_state")
            if getattr(replayed, name) is not None and getattr(eager, name) is not None
        }
        if any(changes.values()):
            words = ", ".join(f"{name} by max-abs {change:.3e}" for name, change in changes.items() if change)
            findings.append(batch_judge.problem(label, f"the replay differs from the eager call: {words}"))
        else:
            findings.append(
                dataclasses.replace(batch_judge.passed(f"{label} against the eager call"), observed="equal")
            )
        findings += batch_judge.result(batch_truth.reference, replayed, batch_truth.budgets, label)
    return findings


CHECK = Check(
    name=NAME,
    title="CUDA-graph replay",
    suite="properties",
    test_name="test_a_captured_graph_replays_new_batches_as_the_eager_call",
    summary="A call captured in a CUDA graph on static buffers, replayed with the case's batch and a second "
    "with moved boundaries (inputs and cu_seqlens rewritten in place), equals the eager call bit for bit and "
    "each replay is within its own truth's budgets; a capture that raises is named.",
    draw=draw,
    run=run,
    ci_seed=0x67726170685F7265706C6179,
    prepare=prepare,
    devices=("cuda",),
    max_examples=1,
)
