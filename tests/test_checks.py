"""The check registry: every check has its test, its page, and a repro line that reruns that very check."""

from __future__ import annotations

import os
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
    planted = Path(__file__).resolve().with_name("plugins") / "kda_planted_bugs.py"  # found by its path
    assert finding.repro.startswith(
        f"kda-conformance run --device cpu --plugin {planted} --backend planted_nan_at_one_position --case "
    )
    assert main([*shlex.split(finding.repro)[1:], "--no-dashboard", "--out", str(tmp_path)]) == 1


@pytest.mark.slow
def test_checks_run_tabulates_every_check_on_one_case(tmp_path: Path) -> None:
    table = tmp_path / "serving.md"
    assert main(["checks", "--run", "--device", "cpu", "--backend", "torch_chunk", "--table", str(table)]) == 0
    rows = [line.split("|")[1:-1] for line in table.read_text().splitlines() if line.startswith("| torch_chunk")]
    seen = {(cells[1].strip(), cells[3].strip()) for cells in rows}
    assert {check for check, _ in seen} == set(CHECKS)
    assert {verdict for _, verdict in seen} == {"pass", "skip"}  # host metadata: torch_chunk takes none
    assert ("cu_seqlens", "pass") in seen and ("padded_tail", "pass") in seen


@pytest.mark.slow
def test_checks_run_side_by_side_gives_the_same_table_and_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--workers: each backend's checks in a process of its own, every process a part of one run; the table
    and the records are those of the same checks run one after another in one process."""
    import pandas as pd

    plugins = Path(__file__).with_name("plugins")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(plugins))
    case = ["--case", Case(seq_lens=(20, 0, 30), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16,
                           head_v_dim=16, initial_state="random").to_json()]  # fmt: skip
    common = ["checks", "--run", "--device", "cpu", "--plugin", "kda_behaviours", *case]
    common += ["--backend", "torch_chunk", "--backend", "test_takes_host_bounds"]
    tables = {}
    for workers in ("1", "2"):
        out = tmp_path / workers
        assert main([*common, "--workers", workers, "--out", str(out), "--table", str(out / "t.md")]) == 0
        tables[workers] = [line for line in (out / "t.md").read_text().splitlines() if line.startswith("| ")]
        [records] = list((out / "runs").glob("*.parquet"))  # one run, whatever the processes
        frame = pd.read_parquet(records)
        assert set(frame["backend"]) == {"torch_chunk", "test_takes_host_bounds"}
        assert not list((out / "runs").glob("*.gw*")), "the parts are merged and removed"
    assert tables["1"] == tables["2"] and len(tables["2"]) > 20


def test_host_syncs_counts_the_backends_own_synchronisations_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync debug mode is on while the backend's own call is in flight only: a synchronisation the suite
    makes around the call (the contract's comparisons) is not counted, the backend's are (on the CPU, torch's
    mode and its warning are stood in for)."""
    import warnings

    from kda_cases.materialize import materialize
    from kda_conformance.checks.host_syncs import count_syncs
    from kda_kernels.guard import run_backend_call, suite_work
    from kda_kernels.torch_chunk import TorchChunk

    mode = {"now": 0}
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.update(now=m))

    def sync() -> None:
        if mode["now"] == "warn":
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    class Syncs(TorchChunk):
        name = "test_syncs_twice"

        def run(self, inputs):
            sync()
            with suite_work(self):  # an adapter's own check inside the call (vLLM's out= buffer) is not counted
                sync()
            sync()
            return super().run(inputs)

    backend = Syncs()
    inputs = materialize(Case(seq_lens=(5,), head_k_dim=16, head_v_dim=16), CPU)

    def call() -> None:
        sync()  # the suite's, before the call
        run_backend_call(backend, inputs)
        sync()  # and after it

    assert count_syncs(call, backend) == 2 and mode["now"] == 0
