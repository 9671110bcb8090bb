"""A run file or a store is data: nothing in it is imported or executed. The repro lines recorded there name
their plugins, and ``minimize --from-run`` and ``triage`` load only the plugins their own command line names
(issue 51: a run file could make the suite import a module beside it)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from suite_paths import PLUGINS

from kda_cases.case import Case
from kda_conformance.cli import main

PLANTED = "planted_nan_at_one_position"


@pytest.fixture
def run_naming_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A store holding one failed run whose repro lines also name ``planted_module``, a module on the path
    that leaves a marker file when imported; the marker's path."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    marker = tmp_path / "imported"
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "planted_module.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    store = tmp_path / "store"
    run = ["run", "--plugin", "kda_planted_bugs", "--backend", PLANTED, "--device", "cpu", "--no-dashboard"]
    assert main([*run, "--case", Case(seq_lens=(40,)).to_json(), "--out", str(store)]) == 1
    records = next((store / "runs").glob("*.parquet"))
    frame = pd.read_parquet(records)
    planted = f"--plugin {(PLUGINS / 'kda_planted_bugs.py').resolve()}"
    frame["repro"] = frame["repro"].str.replace(planted, f"--plugin planted_module {planted}", regex=False)
    frame.to_parquet(records, index=False)
    return records, marker


def test_minimize_from_a_run_imports_no_plugin_the_run_names(
    run_naming_a_module: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    records, marker = run_naming_a_module
    argv = ["minimize", "--plugin", "kda_planted_bugs", "--from-run", str(records), "--device", "cpu"]
    assert main(argv) == 2
    assert "repro line loads --plugin planted_module; pass that to minimize it" in capsys.readouterr().out
    assert not marker.exists()


def test_triage_imports_no_plugin_the_store_names(
    run_naming_a_module: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    records, marker = run_naming_a_module
    store = records.parent.parent
    assert main(["triage", "--store", str(store), "--plugin", "kda_planted_bugs"]) == 0
    out = capsys.readouterr().out
    assert "not rerun:" in out and "loads --plugin planted_module; pass that to rerun it" in out
    assert not marker.exists()
