"""A backend's own text (its exception's message) reaches the records, the JUnit file and the console only
as a record keeps it (kda_reports.findings.recorded_text): credentials redacted by their shape, control
characters escaped, and cut at MAX_TEXT characters saying so (issue 51: a 10 MB message was kept whole in
every row, terminal escape sequences reached the terminal raw, a password echoed from the environment was
recorded verbatim)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs
from kda_conformance.cli import main
from kda_kernels import registry
from kda_kernels.protocol import BackendOutput
from kda_kernels.torch_chunk import TorchChunk
from kda_reports.findings import MAX_TEXT

SECRETS = ("hunter2", "hf_" + "Ab3" * 11, "s3cr3t-pass")
LOUD = (
    "\x1b[2J\x1b[31mkernel failed\x1b[0m: env DB_URL=postgres://app:s3cr3t-pass@db.example/x "
    "--password hunter2 HF=hf_" + "Ab3" * 11 + " " + "x" * 10_000_000
)


class LoudBackend(TorchChunk):
    name = "loud_backend"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise RuntimeError(LOUD)


@pytest.fixture
def loud() -> None:
    registry.register(LoudBackend.name, LoudBackend, replace=True)
    yield
    registry.unregister(LoudBackend.name)


def test_a_backends_message_is_redacted_escaped_and_cut_everywhere(
    loud: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junit = tmp_path / "junit.xml"
    argv = ["run", "--device", "cpu", "--backend", "loud_backend", "--out", str(tmp_path), "--no-dashboard"]
    assert main([*argv, "--case", Case(seq_lens=(20,)).to_json(), "--junit-xml", str(junit)]) == 3  # errored
    console = capsys.readouterr().out
    records = pd.read_parquet(next((tmp_path / "runs").glob("*.parquet")))
    reason = str(records["reason"].iloc[0])
    for text in (reason, junit.read_text(), console):
        assert not any(secret in text for secret in SECRETS), text[:400]
        assert "\x1b" not in text and "kernel failed" in text
    assert "\\x1b[31m" in reason and "<redacted>" in reason
    assert len(reason) < MAX_TEXT + 200 and "more characters]" in reason
    assert junit.stat().st_size < 20 * MAX_TEXT and len(console) < 20 * MAX_TEXT
