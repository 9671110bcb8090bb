"""``kda-conformance minimize``: planted bugs shrink to small cases that fail the same way (docs/overview.md
lists the sizes), the reductions are valid cases, and a run's first failure can be the start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from suite_paths import PLUGINS

from kda_cases.case import Case
from kda_cases.shrink import shorter_lengths, size, smaller_cases
from kda_conformance.cli import main

START = Case(
    seq_lens=(300, 0, 200),
    packed=True,
    num_heads=2,
    num_v_heads=4,
    head_k_dim=64,
    head_v_dim=64,
    initial_state="random",
    checkpoints=((0, 64), (2, 100)),
)


@pytest.fixture(autouse=True)
def planted_bugs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_reductions_are_smaller_valid_cases_and_lengths_keep_boundaries() -> None:
    reductions = list(smaller_cases(START))
    assert reductions and all(size(c) != size(START) for c in reductions)
    assert START.replace(checkpoints=()) in reductions and START.replace(initial_state="none") in reductions
    assert {1, 16, 17, 64, 65, 128, 129, 150} <= set(shorter_lengths(300))
    assert max(shorter_lengths(300)) < 300 and min(shorter_lengths(300)) == 1


# backend -> (the failure kept, the largest minimal size this search must reach)
PLANTED = {
    "planted_nan_at_one_position": ("non-finite o", 34),  # the NaN sits at token 33
    "planted_no_decay_at_chunk_boundary": ("over limit o", 65),  # one chunk boundary
    "planted_packed_state_leak": ("over limit o", 2),  # two sequences
    "planted_state_to_wrong_slot": ("over limit final_state", 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", PLANTED)
def test_planted_bugs_minimize_to_small_cases(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["minimize", "--plugin", "kda_planted_bugs", "--backend", backend, "--device", "cpu"]
    assert main([*argv, "--case", START.to_json(), "--budget-s", "120"]) == 1  # the minimal case fails
    out = capsys.readouterr().out
    kept, most = PLANTED[backend]
    line = next(line for line in out.splitlines() if line.startswith("minimal case"))
    tokens = int(re.search(r"500 -> (\d+) tokens", line).group(1))
    assert tokens <= most and line.rstrip().endswith(f"still {kept}"), line
    assert "heads 2/4 -> 1/1" in line and "K x V 64x64 -> 16x16" in line
    planted = (PLUGINS / "kda_planted_bugs.py").resolve()
    assert f"repro: kda-conformance run --device cpu --plugin {planted} --backend {backend} --case" in out


def test_a_passing_case_has_nothing_to_minimize(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["minimize", "--backend", "torch_chunk", "--device", "cpu", "--case", '{"seq_lens": [20]}']
    assert main(argv) == 0
    assert "passes check budget on torch_chunk: nothing to minimize" in capsys.readouterr().out


@pytest.mark.slow
def test_a_runs_first_failure_is_minimized(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = ["run", "--plugin", "kda_planted_bugs", "--backend", "planted_nan_at_one_position", "--device", "cpu"]
    assert main([*run, "--case", START.to_json(), "--out", str(tmp_path), "--no-dashboard"]) == 1
    records = next((tmp_path / "runs").glob("*.parquet"))
    argv = ["minimize", "--plugin", "kda_planted_bugs", "--from-run", str(records), "--device", "cpu"]
    assert main([*argv, "--write-test", str(tmp_path / "test_minimal.py")]) == 1
    out = capsys.readouterr().out
    assert "500 -> 34 tokens" in out and "standalone test:" in out
    assert '"seq_lens": [' in (tmp_path / "test_minimal.py").read_text()


def test_a_runs_first_failure_of_a_check_with_parameters_is_minimized_with_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``minimize --from-run`` read the failure's parameters (``--at 11``) and then lost them to the set of
    plugins it was given: every check with parameters said "check prefix needs --at"."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    case = '{"seq_lens": [40], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'
    repro = ["repro", "--plugin", "kda_planted_bugs", "--backend", "planted_future_leak", "--check", "prefix"]
    main([*repro, "--at", "11", "--device", "cpu", "--case", case, "--out", str(tmp_path)])
    records = next((tmp_path / "runs").glob("*.parquet"))
    capsys.readouterr()
    argv = ["minimize", "--plugin", "kda_planted_bugs", "--from-run", str(records), "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "min")]) == 1
    out = capsys.readouterr().out
    assert "needs --at" not in out and "40 -> 12 tokens" in out and "--at 11 --check prefix" in out
