"""One backend call in a process of its own, for probes that may kill the process (a kernel given stale
metadata reads past its tensors: a segfault in Triton's CPU interpreter, an illegal address on a GPU).

The child is spawned (no CUDA context may be forked), rebuilds the case's inputs from its seed on the
device, runs the backend with the host metadata it is given, and sends back the output and final state
(on the CPU), or the exception; a child that dies or hangs is reported as such.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from kda_cases.case import Case
from kda_cases.materialize import materialize
from kda_kernels.protocol import Backend


@dataclass(frozen=True)
class ProbeResult:
    o: torch.Tensor | None = None
    final_state: torch.Tensor | None = None
    raised: str = ""  # the exception, where the call raised
    died: str = ""  # how the process ended, where it died or hung


def _child(conn: Connection, case_json: str, backend: Backend, device: str, metadata: dict, parent: int) -> None:
    import dataclasses

    from kda_conformance.running.blame import raised_at
    from kda_conformance.running.faults import die_with_parent

    die_with_parent(parent)

    inputs = materialize(Case.from_json(case_json), device)
    try:
        result = backend.run(dataclasses.replace(inputs, host_metadata=metadata))
        if inputs.device.type == "cuda":
            torch.cuda.synchronize(inputs.device)
        # As bytes: a tensor pickled through torch's reductions would share memory with a process that ends.
        final = None if result.final_state is None else result.final_state.cpu()  # a backend that returns none
        conn.send(_pack({"o": result.o.cpu(), "final_state": final}))
    except Exception as exc:
        conn.send(ProbeResult(raised=raised_at(exc)))


def _pack(tensors: dict[str, torch.Tensor | None]) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def probe(case: Case, backend: Backend, device: torch.device, metadata: dict, timeout: float = 600.0) -> ProbeResult:
    """``backend`` on ``case`` with ``metadata`` passed in, in a spawned process (see the module docstring)."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=_child,
        args=(child, case.to_json(), backend, str(device), metadata, os.getpid()),
        daemon=True,
    )
    process.start()
    child.close()
    try:
        if parent.poll(timeout):
            sent = parent.recv()
            return sent if isinstance(sent, ProbeResult) else ProbeResult(**torch.load(io.BytesIO(sent)))
        return ProbeResult(died=f"no result within {timeout:g} s: its process was killed")
    except (EOFError, ConnectionError):
        process.join(timeout=30)
        code = process.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return ProbeResult(died=f"its process died ({how})")
    finally:
        if process.is_alive():
            process.kill()
        process.join(timeout=30)
