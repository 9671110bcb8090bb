"""The habits a kernel engineer brings: pytest's -k, --lf and JUnit XML work on the conformance tests, a
failure says what it must once, detection takes a subset of planted bugs and named controls, --version."""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from suite_paths import ENV, PLUGINS, REPO, pytest_run

from kda_cases.case import Case
from kda_conformance.cli import main
from kda_conformance.cli.detection import pytest_command


def pytest_in(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A pytest run with its cache and its run store in ``tmp_path``."""
    return pytest_run("-o", f"cache_dir={tmp_path / 'cache'}", "--kda-out", str(tmp_path / "out"), *args)


def test_test_ids_read_and_select_by_the_cases_label() -> None:
    case = Case(seq_lens=(2049,), dtype="fp32", initial_state="random")
    assert case.test_id.startswith("T2049_fp32_H2/2_K64V64_lb-5_h0:random-kda-") and case.test_id.endswith(case.id)
    assert "scale0.25" in Case(seq_lens=(9,), scale=0.25).label  # two cases apart by their scale print apart


@pytest.mark.slow
def test_a_failure_says_it_once_with_its_ratio_and_repro_and_lf_and_junit_work(tmp_path: Path) -> None:
    select = ["conformance/test_corpus.py", "-k", "bf16 and T130", "--kda-plugin", "kda_planted_bugs"]
    select += ["--kda-backend", "planted_nan_at_one_position", "--kda-backend", "torch_chunk"]
    done = pytest_in(tmp_path, *select, "--junitxml", str(tmp_path / "junit.xml"))
    assert done.returncode == 1, done.stdout[-3000:]
    failures = done.stdout.split("= FAILURES =")[1].split("short test summary")[0]
    planted = (PLUGINS / "kda_planted_bugs.py").resolve()
    assert failures.count(f"repro: kda-conformance run --device cpu --plugin {planted}") == 1
    assert "x its limit" in failures and "reproduce_failure" not in failures and "assert None" not in failures
    assert "Traceback" not in failures and "AssertionError" not in failures
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    failed = [case for case in suite.iter("testcase") if case.find("failure") is not None]
    assert failed and all("T130" in case.get("name", "") and "bf16" in case.get("name", "") for case in failed)
    properties = {p.get("name"): p.get("value") for p in failed[0].iter("property")}
    assert {"kda_case_id", "kda_backend", "kda_check", "kda_worst_ratio", "kda_repro"} <= set(properties)
    assert properties["kda_backend"] == "planted_nan_at_one_position" and properties["kda_worst_ratio"] == "inf"
    again = pytest_in(tmp_path, *select, "--lf")
    assert again.returncode == 1 and f"{len(failed)} failed" in again.stdout and " passed" not in again.stdout


@pytest.mark.slow
def test_detection_takes_planted_bugs_and_correct_controls_and_counts_warnings_when_strict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    argv = ["detection", "--plugin", "kda_behaviours", "--planted", "test_nondeterministic"]
    argv += ["--correct", "torch_chunk", "--profile", "smoke", "--out", str(tmp_path)]
    assert main([*argv, "--strict"]) == 0  # the nondeterminism warning is a catch under --strict
    table = capsys.readouterr().out.split("| backend")[1]
    assert "| test_nondeterministic" in table and "| torch_chunk" in table and "test_garbage_tail" not in table
    assert "--kda-strict" in pytest_command(["a"], [], "ci", "cpu", tmp_path, strict=True)
    assert "--kda-strict" not in pytest_command(["a"], [], "ci", "cpu", tmp_path)


def test_version_names_the_package_and_the_commit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("kda-conformance 0.1.0 (commit ")


def test_every_command_checks_its_inputs_before_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    big = ["run", "--device", "cpu", "--backend", "torch_chunk", "--lengths", "100000000", "--heads", "64"]
    assert main([*big, "--out", str(tmp_path)]) == 2
    said = capsys.readouterr().out
    assert "needs about" in said and "GiB at its peak" in said and not list((tmp_path / "runs").glob("*"))
    assert main(["benchmark", "--backend", "no_such_backend", "--lengths", "16"]) == 2
    assert "--backend: ['no_such_backend'] unknown" in capsys.readouterr().out
    for bad in (["--lengths", "-3"], ["--heads", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as done:
            main(["benchmark", *bad])
        assert done.value.code == 2
    # The suite's own corpus files are cases too (--case takes what `corpus add` wrote).
    corpus = REPO / "cases" / "corpus" / "kda-7735f63ee3cc.json"
    assert (
        main(["run", "--device", "cpu", "--backend", "torch_chunk", "--case", str(corpus), "--out", str(tmp_path)]) == 0
    )


def test_the_cpu_allocator_running_out_is_out_of_memory() -> None:
    from kda_conformance.running.faults import is_out_of_memory

    message = "[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you tried to allocate"
    assert is_out_of_memory(RuntimeError(message)) and is_out_of_memory(MemoryError())


def test_tritons_driver_out_of_memory_is_the_machines_and_a_kernels_own_words_are_not() -> None:
    from kda_conformance.running.faults import is_out_of_memory

    assert is_out_of_memory(RuntimeError("Triton Error [CUDA]: out of memory"))
    assert not is_out_of_memory(RuntimeError("my_kernel: scratch out of memory"))


def test_checks_run_prints_a_repro_line_for_each_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    case = Case(seq_lens=(20, 0, 13), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    argv = ["checks", "--run", "--device", "cpu", "--plugin", "kda_planted_bugs", "--backend", "planted_future_leak"]
    assert main([*argv, "--case", case.to_json()]) == 1
    out = capsys.readouterr().out
    assert "checking planted_future_leak: prefix --at 11" in out and "{" not in out.split("checking")[1][:60]
    assert "FAIL planted_future_leak prefix --at 11; repro: kda-conformance repro --device cpu --plugin" in out
    # A kernel wrong under every cu_seqlens pattern has a numerical error, not a broken in-place contract.
    cu_rows = [line for line in out.splitlines() if "| cu_seqlens" in line]
    assert cu_rows and not any("contract broken" in line for line in cu_rows), cu_rows


def test_the_module_map_is_the_tree(tmp_path: Path) -> None:
    """docs/modules.md lists every module of the five packages, generated from the tree; a new module
    without its line fails here, and so does a module without a docstring."""
    from kda_conformance.cli.reference import modules_markdown

    page = (REPO / "docs" / "modules.md").read_text()
    stale = "docs/modules.md is stale: python -m kda_conformance.cli.reference docs/modules.md"
    assert page == modules_markdown(), stale
    assert "(no docstring)" not in page
    # A module added to a package shows up in the map made from that tree.
    tree = tmp_path / "repo"
    for folder in ("cases", "reference", "kernels", "reports", "conformance"):
        (tree / folder).mkdir(parents=True)
        (tree / folder / "__init__.py").write_text(f'"""The {folder}."""\n')
    (tree / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tree / "kernels" / "new_adapter.py").write_text('"""A new adapter: it calls a kernel. More words."""\n')
    assert "| `kernels/new_adapter.py` | A new adapter: it calls a kernel. |" in modules_markdown(tree)


def test_the_command_line_reference_is_the_parser() -> None:
    from kda_conformance.cli.reference import cli_markdown

    assert (REPO / "docs" / "cli.md").read_text() == cli_markdown(), (
        "docs/cli.md is stale: python -m kda_conformance.cli.reference docs/cli.md"
    )
    # A command's own subcommands are there with their options (corpus's table was empty).
    page = cli_markdown()
    add = page[page.index("### `kda-conformance corpus add`") :]
    assert "| `--from-run` RUN_FILE |" in add.split("\n## ")[0] and "|---|---|\n\n" not in page


def test_the_code_says_why_not_when() -> None:
    """A measurement that justifies code is cited by what was measured, with its numbers in the results
    journal (docs/results/); no comment, docstring or message of the five packages carries a date."""
    dated = re.compile(r"20\d\d-[01]\d-[0-3]\d")
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in ("cases", "reference", "kernels", "reports", "conformance")
        for path in sorted((REPO / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if dated.search(line)
    ]
    assert not found, f"dates in the code (move the measurement to docs/results/): {found}"


def test_a_run_option_is_one_entry_of_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option that configures the run is a keyword of build_config and a field of RunConfig (or folded
    into one), and both front ends hand them over from the table (config_keywords); an option added to the
    table reaches the command line, pytest, the pytest command lines of nightly and detection, the docs and
    the run's keywords."""
    import argparse
    import dataclasses
    import inspect

    from kda_conformance.running import options
    from kda_conformance.running.config import RunConfig, build_config

    keywords = set(inspect.signature(build_config).parameters)
    fields = {field.name for field in dataclasses.fields(RunConfig)}
    # The one option that is no field of its own: build_config folds it into the profile it draws from.
    folded = {"examples": "profile.max_examples"}
    for option in options.OPTIONS.values():
        if option.configures:
            assert option.keyword in keywords, f"--{option.name} is no keyword of build_config"
            assert option.keyword in fields or option.keyword in folded, f"--{option.name} is no field of RunConfig"
    dummy = options.Option("dummy-knob", "a knob added in one place", 3, int, "number", configures=False)
    monkeypatch.setitem(options.OPTIONS, "dummy-knob", dummy)
    parser = argparse.ArgumentParser()
    options.add_options(parser, ["dummy-knob"])
    assert parser.parse_args(["--dummy-knob", "5"]).dummy_knob == 5
    added: list[str] = []
    options.add_pytest_options(type("Group", (), {"addoption": lambda self, name, **kw: added.append(name)})())
    assert "--kda-dummy-knob" in added
    assert options.pytest_argv({"dummy-knob": 7}) == ["--kda-dummy-knob", "7"]
    assert "`--kda-dummy-knob`" in options.options_markdown()
    configuring = dataclasses.replace(dummy, name="dummy-level", configures=True)
    monkeypatch.setitem(options.OPTIONS, "dummy-level", configuring)
    assert options.config_keywords(lambda o: 1 if o.name == "dummy-level" else options.MISSING) == {"dummy_level": 1}


def test_a_check_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check registered in one place reaches the pytest tests made from the registry, repro's --check and its
    parameters, and the checks page."""
    import dataclasses

    from kda_conformance.checks import CHECKS, Param, get_check
    from kda_conformance.checks._tests import suite_tests
    from kda_conformance.cli import build_parser
    from kda_conformance.cli.checks import checks_markdown

    dummy = dataclasses.replace(
        get_check("determinism"),
        name="dummy_check",
        title="a dummy",
        test_name="test_a_dummy_holds",
        summary="A check added in one place.",
        params=(Param("knob", int, "a dummy's parameter"),),
    )
    monkeypatch.setitem(CHECKS, "dummy_check", dummy)
    assert "test_a_dummy_holds" in suite_tests(dummy.suite)
    argv = ["repro", "--backend", "torch_chunk", "--check", "dummy_check", "--knob", "3", "--case", '{"seq_lens": [9]}']
    args = build_parser().parse_args(argv)
    assert (args.check, args.knob) == ("dummy_check", 3)
    assert "| `dummy_check` | a dummy | `conformance/test_properties.py::test_a_dummy_holds` | `--knob` |" in (
        checks_markdown()
    )
