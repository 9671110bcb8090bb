"""Backends for the tests of ``kda-conformance triage`` (tests/test_triage.py): a kernel whose float32 matmuls are
TF32 unless ``TRITON_F32_DEFAULT=ieee`` is set before it runs, undeclared (what triage's IEEE switch clears),
and one that aborts the process on a zero-length member, as a CUDA extension's failed assertion does (cleared
by removing them). The zero-length member bug that shifts states is the zoo's (tests/plugins/kda_planted_bugs.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from kda_kernels.api import BackendOutput, KDAInputs, register
from kda_kernels.torch_chunk import TorchChunk


class Tf32UnlessIeee(TorchChunk):
    name = "triage_tf32_unless_ieee"
    description = "float32 matmul operands rounded to TF32 unless TRITON_F32_DEFAULT=ieee, undeclared"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        self.tf32_dots = None if os.environ.get("TRITON_F32_DEFAULT") == "ieee" else "nearest"
        return super().run(inputs)


class AbortsOnEmptyMember(TorchChunk):
    name = "triage_aborts_on_empty_member"
    description = "the process aborts (SIGABRT) when a packed batch holds a zero-length member"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        if inputs.case.packed and 0 in inputs.case.seq_lens:
            os.abort()
        return super().run(inputs)


class HangsWithAChild(TorchChunk):
    name = "triage_hangs_with_a_child"
    # The child's pid goes to the file KDA_TEST_CHILD_PID names.
    description = "the call starts a child (as --isolate starts a worker) and never returns"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        child = subprocess.Popen(["sleep", "120"])
        Path(os.environ["KDA_TEST_CHILD_PID"]).write_text(str(child.pid))
        time.sleep(120)
        return super().run(inputs)


register(Tf32UnlessIeee.name, Tf32UnlessIeee)
register(HangsWithAChild.name, HangsWithAChild)
register(AbortsOnEmptyMember.name, AbortsOnEmptyMember)
