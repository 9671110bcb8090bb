"""Every failure has a tier: broken, beyond the tolerance the library's own tests assert, or beyond the suite's
working-precision limits only (kda_reports.findings Finding.tier); records, run's failure blocks, the JUnit
file and the dashboard carry it, and verdicts and exit codes do not change with it."""

from __future__ import annotations

import dataclasses
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest

from kda_cases.case import Case
from kda_conformance.cli import main
from kda_conformance.running.run import with_library_tolerance
from kda_kernels import registry
from kda_kernels.protocol import Library, LibraryTolerance
from kda_kernels.torch_chunk import TorchChunk
from kda_reports.dashboard import tier_counts
from kda_reports.findings import (
    BEYOND_LIBRARY,
    BEYOND_PRECISION,
    BROKEN,
    NO_CONTRACT,
    Budget,
    Errors,
    Finding,
    Limit,
    grouped_failures,
)
from kda_reports.junit import junit_xml
from kda_reports.schema import record_rows

CASE = Case(seq_lens=(40,))
CONTRACT = LibraryTolerance(0.005, ("o",), "tests/test_tiers.py (a test's library)")


class WithContract(TorchChunk):
    name = "test_with_contract"
    libraries = (Library("a library", tolerance=CONTRACT),)


def finding(verdict: str = "fail", rel_rms: float = 0.004, **fields: object) -> Finding:
    limit = Limit("max_abs", 1.0, 1.0, 0.0, 1.0, "baseline")
    budget = Budget("o", limit, dataclasses.replace(limit, metric="rel_rms", value=0.002))
    errors = Errors(fields.pop("max_abs", 0.5), rel_rms, 0.5, fields.pop("nonfinite", 0), fields.pop("shape_ok", True))
    return Finding("budget", CASE, "test_with_contract", "cpu", verdict, tensor="o", errors=errors, budget=budget,
                   **fields)  # fmt: skip


def test_the_tier_says_how_bad_a_failure_is() -> None:
    [within, beyond] = with_library_tolerance([finding(rel_rms=0.004), finding(rel_rms=0.02)], WithContract())
    assert within.library_tolerance == 0.005 and within.library_ratio == pytest.approx(0.8)
    assert within.tier == BEYOND_PRECISION and beyond.tier == BEYOND_LIBRARY
    assert finding().tier == NO_CONTRACT  # no library tolerance stated
    assert finding(nonfinite=3).tier == BROKEN and finding(shape_ok=False).tier == BROKEN
    assert finding(max_abs=math.inf).tier == BROKEN
    assert finding(problems=("dtype float32 != expected bfloat16",)).tier == BROKEN
    assert dataclasses.replace(finding(), verdict="error", errors=None, budget=None).tier == BROKEN
    memory = Finding("poison", CASE, "x", "cpu", "fail", subject="slot 3", problems=("slot 3 written",))
    assert memory.tier == BROKEN
    assert dataclasses.replace(finding(), check="determinism").tier == BROKEN
    assert finding("pass").tier == "" and finding("warn").tier == ""
    # Known failures keep their tier: a ledger entry excuses, it does not make a crash less of one.
    assert dataclasses.replace(finding(nonfinite=1), verdict="known").tier == BROKEN


def test_a_state_the_librarys_tests_do_not_hold_has_no_library_ratio() -> None:
    state = dataclasses.replace(finding(rel_rms=0.02), tensor="final_state")
    [state] = with_library_tolerance([state], WithContract())
    assert math.isnan(state.library_tolerance) and state.tier == NO_CONTRACT


def test_records_junit_blocks_and_dashboard_carry_the_tier() -> None:
    findings = with_library_tolerance([finding(rel_rms=0.02), finding(nonfinite=2)], WithContract())
    rows = pd.DataFrame(record_rows(findings))
    assert list(rows["tier"]) == [BEYOND_LIBRARY, BROKEN]
    assert rows["library_ratio"].iloc[0] == pytest.approx(4.0)
    suite = ET.fromstring(junit_xml(rows.assign(run_id="r")))
    [case] = suite.findall("testcase")
    assert {p.get("name"): p.get("value") for p in case.iter("property")}["tier"] == BROKEN
    assert case.find("failure").get("message").startswith(f"[{BROKEN}]")
    [(label, text)] = grouped_failures(findings[:1])
    assert label == "FAIL" and f"[{BEYOND_LIBRARY}]" in text.splitlines()[0]
    assert "the library's own tests allow rel-RMS 0.005: 4x that" in text and f"tier: {BEYOND_LIBRARY}" in text
    counts = tier_counts(rows).set_index("backend")
    assert counts.loc["test_with_contract", BROKEN] == 1 and counts.loc["test_with_contract", BEYOND_LIBRARY] == 1


def test_the_libraries_state_the_tolerance_of_their_own_tests() -> None:
    fla = registry.get("fla_chunk").library_tolerance
    assert fla is not None and fla.rel_rms == 0.005 and set(fla.tensors) == {"o", "final_state"}
    assert "tests/ops/test_kda.py" in fla.source
    assert registry.get("aiter_default").library_tolerance.rel_rms == 0.02
    assert registry.get("flashkda_cuda").library_tolerance.tensors == ("o",)
    assert registry.get("sglang_chunk").library_tolerance is None  # not established
    with pytest.raises(ValueError, match="source"):
        LibraryTolerance(0.005, ("o",), " ")
    with pytest.raises(ValueError, match="tensors"):
        LibraryTolerance(0.005, ("h",), "x")


def test_a_runs_records_hold_the_librarys_tolerance_and_the_verdicts_do_not_move(tmp_path: Path) -> None:

    registry.register(WithContract.name, WithContract)
    try:
        argv = ["run", "--device", "cpu", "--backend", WithContract.name, "--lengths", "37", "--dtypes", "bf16"]
        assert main([*argv, "--out", str(tmp_path), "--no-dashboard"]) == 0
    finally:
        registry.unregister(WithContract.name)
    records = pd.read_parquet(next((tmp_path / "runs").glob("*.parquet")))
    outputs, states = records[records["tensor"] == "o"], records[records["tensor"] == "final_state"]
    assert set(outputs["library_tolerance"]) == {0.005} and states["library_tolerance"].isna().all()
    assert set(records["verdict"]) == {"pass"} and set(records["tier"].fillna("")) == {""}
