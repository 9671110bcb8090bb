"""Each property of conformance/test_properties.py catches the planted bug it exists for, in the ci profile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).with_name("plugins")
REPO = Path(__file__).resolve().parent.parent


def run_property(test: str, backend: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            f"conformance/test_properties.py{'::' + test if test else ''}",
            "-q",
            "--kda-device",
            "cpu",
            "--kda-profile",
            "ci",
            "--kda-plugin",
            "kda_planted_properties",
            "--kda-backend",
            backend,
            "--kda-out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(PLUGINS)},
    )


@pytest.mark.parametrize(
    ("test", "backend", "message"),
    [
        ("test_prefix_outputs_ignore_later_tokens", "planted_future_leak", "outputs before token"),
        ("test_packed_sequences_match_each_sequence_alone", "planted_packed_state_leak", "packed differs from alone"),
        ("test_split_resume_equals_whole_run", "planted_ignores_initial_state", "split at p="),
    ],
)
def test_property_catches_its_bug(test: str, backend: str, message: str, tmp_path: Path) -> None:
    done = run_property(test, backend, tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    assert message in done.stdout and f"kda-conformance run --device cpu --backend {backend}" in done.stdout, (
        done.stdout[-3000:]
    )


def test_correct_baseline_passes_every_property(tmp_path: Path) -> None:
    done = run_property("", "torch_chunk", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "4 passed" in done.stdout
