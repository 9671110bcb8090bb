"""Each property of conformance/test_properties.py catches the planted bug it exists for, in the ci profile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PLUGINS = Path(__file__).with_name("plugins")
REPO = Path(__file__).resolve().parent.parent


PLANTED = {
    # backend: (the property that must catch it, what its failure says)
    "planted_future_leak": ("test_prefix_outputs_ignore_later_tokens", "outputs before token"),
    "planted_packed_state_leak": ("test_packed_sequences_match_each_sequence_alone", "packed differs from alone"),
    "planted_ignores_initial_state": ("test_split_resume_equals_whole_run", "split at p="),
}


def run_properties(backends: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    selected = [arg for name in backends for arg in ("--kda-backend", name)]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "conformance/test_properties.py",
            "-q",
            "-rf",
            "--kda-device",
            "cpu",
            "--kda-profile",
            "ci",
            "--kda-plugin",
            "kda_planted_properties",
            *selected,
            "--kda-out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(PLUGINS)},
    )


def test_each_property_catches_its_bug_and_the_baseline_passes(tmp_path: Path) -> None:
    done = run_properties([*PLANTED, "torch_chunk"], tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    failed = set(re.findall(r"^FAILED (\S+)", done.stdout, flags=re.MULTILINE))
    for backend, (test, message) in PLANTED.items():
        assert f"conformance/test_properties.py::{test}[{backend}]" in failed, (backend, sorted(failed))
        assert message in done.stdout and f"kda-conformance run --device cpu --backend {backend}" in done.stdout
    assert not any("[torch_chunk]" in name for name in failed), sorted(failed)
