"""The check registry: every check has its test, its page, and a repro line that reruns that very check."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.profiles import get_profile
from kda_conformance import test_properties, test_serving
from kda_conformance.checks import CHECKS, get_check, run_check
from kda_conformance.cli import main
from kda_conformance.cli.checks import checks_markdown
from kda_kernels import registry

DOCS = Path(__file__).resolve().parent.parent / "docs" / "checks.md"
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("planted_zoo")


def test_every_check_has_its_test_in_its_suite_and_a_line_on_its_page() -> None:
    modules = {"properties": test_properties, "serving": test_serving}
    for check in CHECKS.values():
        test = getattr(modules[check.suite], check.test_name)
        assert test.kda_check is check and test.__doc__ == check.summary
    assert DOCS.read_text() == checks_markdown(), (
        "docs/checks.md is stale: kda-conformance checks --table docs/checks.md"
    )


@pytest.mark.parametrize("name", list(CHECKS))
def test_checks_draw_their_parameters_and_a_case_they_leave_unchanged(name: str) -> None:
    check, backend = get_check(name), registry.get("torch_chunk")

    @settings(max_examples=5, derandomize=True, database=None, deadline=None)
    @given(data=st.data())
    def drawn(data: st.DataObject) -> None:
        got = check.draw(data, get_profile("ci"), backend)
        assert set(got.params) == {p.name for p in check.params}
        assert check.prepare(got.case, backend) == got.case

    drawn()


# A planted bug each check catches, a case on which it does, and the check's parameters.
RERUNS = {
    "split_resume": ("planted_ignores_initial_state", Case(seq_lens=(40,), initial_state="random"), "--at 17"),
    "prefix": ("planted_future_leak", Case(seq_lens=(40,)), "--at 20"),
    "poison": ("planted_padding_writes_slot0", Case(seq_lens=(20, 13), packed=True), "--poison nan"),
}


@pytest.mark.parametrize("name", sorted(RERUNS))
def test_a_failed_check_s_repro_line_reruns_that_check(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    backend, case, params = RERUNS[name]
    check = get_check(name)
    drawn = {p.name: p.parse(value) for p, value in zip(check.params, params.split()[1::2], strict=True)}
    failed = [f for f in run_check(check, case, registry.get(backend), CPU, drawn) if f.failed]
    assert failed, f"{backend} passed {name}"
    repro = failed[0].repro
    assert f"--check {name}" in repro and params in repro and f"--backend {backend}" in repro
    capsys.readouterr()
    assert main(shlex.split(repro)[1:]) == 1
    out = capsys.readouterr().out
    assert f"check {name}" in out and "FAIL" in out


def test_the_budget_check_reruns_through_run(tmp_path: Path) -> None:
    backend = registry.get("planted_nan_at_one_position")
    [finding] = [f for f in run_check(get_check("budget"), Case(seq_lens=(40,)), backend, CPU) if f.failed]
    assert finding.repro.startswith(
        "kda-conformance run --device cpu --plugin kda_planted_bugs --backend planted_nan_at_one_position --case "
    )
    assert main([*shlex.split(finding.repro)[1:], "--no-dashboard", "--out", str(tmp_path)]) == 1


def test_checks_run_tabulates_every_check_on_one_case(tmp_path: Path) -> None:
    table = tmp_path / "serving.md"
    assert main(["checks", "--run", "--device", "cpu", "--backend", "torch_chunk", "--table", str(table)]) == 0
    rows = [line.split("|")[1:-1] for line in table.read_text().splitlines() if line.startswith("| torch_chunk")]
    seen = {(cells[1].strip(), cells[3].strip()) for cells in rows}
    assert {check for check, _ in seen} == set(CHECKS)
    assert {verdict for _, verdict in seen} == {"pass", "skip"}  # host metadata: torch_chunk takes none
    assert ("cu_seqlens", "pass") in seen and ("padded_tail", "pass") in seen
