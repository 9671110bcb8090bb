"""Backends from plugins, the `kda-conformance run` command and the report a pytest run leaves."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from suite_paths import PLUGINS, REPO

from kda_conformance.cli import main
from kda_kernels import registry


@pytest.fixture
def example_plugin(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.syspath_prepend(str(PLUGINS))
    return "kda_example_plugin"


def test_cli_run_with_a_plugin_backend_writes_a_report(example_plugin: str, tmp_path: Path) -> None:
    rc = main(
        [
            "run",
            "--plugin",
            example_plugin,
            "--backend",
            "example_rounded_reference",
            "--device",
            "cpu",
            "--lengths",
            "5,9",
            "--dtypes",
            "fp32",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    [parquet] = (tmp_path / "runs").glob("*.parquet")
    frame = pd.read_parquet(parquet)
    assert set(frame["backend"]) == {"example_rounded_reference"}
    assert set(frame["tensor"]) == {"o", "final_state"}
    assert (frame["verdict"] == "pass").all()
    assert len(frame) == 2 * 5  # (2 lengths x 2 initial states + 1 packed) x 2 tensors
    assert {"case_id", "case_dtype", "max_abs", "rel_rms", "env_torch", "env_fla", "run_id"} <= set(frame.columns)
    assert (tmp_path / "runs" / f"{frame['run_id'][0]}.summary.md").read_text().startswith("# KDA conformance run")


def test_cli_rejects_bad_input_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--backend", "no_such_backend", "--device", "cpu"]) == 2
    assert "--backend: ['no_such_backend'] unknown; known backends:" in capsys.readouterr().out
    assert main(["run", "--plugin", "no.such.module", "--device", "cpu"]) == 2
    assert "plugin module 'no.such.module' cannot be imported" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--dtypes", "fp8"])
    assert "choose from bf16, fp16, fp32" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["run", "--case", '{"seq_lens": ' + "[" * 100_000 + "]" * 100_000 + "}"],
            "--case: not a valid case: its JSON is nested too deep",
        ),
        (["run", "--case", '{"seq_lens": [20], "seed": 1180591620717411303424}'], "seed must be within +-(2^63 - 1)"),
        (["run", "--case", '{"seq_lens": [20], "tags": {"a": 1}}'], "tags must be a list, got {'a': 1}"),
        (["run", "--seed", str(2**70), "--lengths", "20"], "seed must be an integer from 0 to 2^63 - 1"),
        (["detection", "--seed", str(2**70)], "--seed must be an integer from 0 to 2^63 - 1"),
    ],
    ids=["json-nested-100k-deep", "case-seed-2^70", "tags-a-dict", "run-seed-2^70", "detection-seed-2^70"],
)
def test_a_hostile_option_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--device", "cpu"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and "Traceback" not in err


def test_register_refuses_duplicates_and_bad_names() -> None:
    with pytest.raises(ValueError, match="already registered"):
        registry.register("fla_chunk", object)
    with pytest.raises(ValueError, match="must be letters"):
        registry.register("bad name", object)


def test_a_backend_must_call_itself_by_its_registered_name() -> None:
    from kda_kernels.torch_chunk import TorchChunk

    registry.register("impostor", TorchChunk)  # records would say torch_chunk for a backend run as impostor
    try:
        with pytest.raises(registry.PluginError, match="registered as 'impostor' names itself 'torch_chunk'"):
            registry.get("impostor")
    finally:
        registry.unregister("impostor")


def test_pytest_run_with_plugin_leaves_a_report(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "conformance/test_first_sweep.py",
            "-q",
            "--kda-device",
            "cpu",
            "--kda-plugin",
            "kda_example_plugin",
            "--kda-backend",
            "example_rounded_reference",
            "--kda-lengths",
            "7",
            "--kda-dtypes",
            "fp32",
            "--kda-out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(PLUGINS)},
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "3 passed" in done.stdout
    [parquet] = (tmp_path / "runs").glob("*.parquet")
    frame = pd.read_parquet(parquet)
    assert len(frame) == 6 and set(frame["verdict"]) == {"pass"}
    assert frame["test"].str.contains("test_first_sweep").all()


def test_entry_point_plugins_load_on_first_lookup(monkeypatch: pytest.MonkeyPatch, example_plugin: str) -> None:
    import importlib.metadata

    # The module and the registry are put back together afterwards: a module left imported while the
    # registry forgets its backends would make later tests' plugin imports no-ops.
    monkeypatch.setitem(sys.modules, example_plugin, None)
    del sys.modules[example_plugin]
    entry = importlib.metadata.EntryPoint(name="example", value=example_plugin, group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [entry])
    monkeypatch.setattr(registry, "_FACTORIES", {})
    monkeypatch.setattr(registry, "_loaded", False)
    assert "example_rounded_reference" in registry.names()
    assert "fla_chunk" in registry.names()


def test_broken_entry_point_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    entry = importlib.metadata.EntryPoint(name="broken", value="no_such_plugin_mod", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [entry])
    monkeypatch.setattr(registry, "_FACTORIES", {})
    monkeypatch.setattr(registry, "_loaded", False)
    with pytest.raises(registry.PluginError, match="entry point 'broken'"):
        registry.names()


def test_planted_nan_fails_with_its_first_bad_token(example_plugin: str, tmp_path: Path) -> None:
    rc = main(
        [
            "run",
            "--plugin",
            example_plugin,
            "--backend",
            "example_planted_nan",
            "--device",
            "cpu",
            "--lengths",
            "20,30",
            "--dtypes",
            "bf16",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 1
    frame = pd.read_parquet(next((tmp_path / "runs").glob("*.parquet")))
    outputs = frame[frame["tensor"] == "o"]
    assert (outputs["verdict"] == "fail").all() and (outputs["nonfinite"] == 1).all()
    assert set(outputs["first_bad"]) == {"seq 0 token 17 head 0"}
    assert (frame[frame["tensor"] == "final_state"]["verdict"] == "pass").all()


def test_detection_names_its_problems(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["detection"]) == 2  # no plugin, no backend: nothing to run
    assert "no backends" in capsys.readouterr().out
    assert main(["detection", "--plugin", "no_such_module_here"]) == 2
    assert "no_such_module_here" in capsys.readouterr().out


@pytest.mark.parametrize("strict", [None, "--kda-strict", "KDA_STRICT=1"])
def test_strict_mode_turns_a_missing_backend_into_a_failure(strict: str | None, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).with_name("plugins"))}
    env.pop("KDA_STRICT", None)
    args = ["conformance/test_corpus.py", "-q", "-rsf", "--kda-device", "cpu", "--kda-out", str(tmp_path)]
    args += ["--kda-plugin", "kda_unavailable", "--kda-backend", "needs_an_accelerator", "-k", "kda-7735f63ee3cc"]
    if strict == "--kda-strict":
        args.append(strict)
    elif strict:
        env["KDA_STRICT"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", *args], capture_output=True, text=True, env=env, cwd=REPO)
    reason = "needs_an_accelerator cannot run on cpu: the accelerator this backend needs is not in this machine"
    assert reason in done.stdout, done.stdout[-2000:]
    assert done.returncode == (0 if strict is None else 1), done.stdout[-2000:]
    assert ("1 skipped" if strict is None else "1 error") in done.stdout


def test_a_run_in_which_nothing_ran_says_so_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--backend", "aiter_default", "--device", "cpu", "--lengths", "37", "--dtypes", "bf16"]
    env_src = os.environ.pop("KDA_AITER_SRC", None)  # AITER then cannot run on the CPU: every case skips
    try:
        assert main([*argv, "--out", str(tmp_path / "fresh")]) == 5
        assert "nothing ran: no case ran on any selected backend" in capsys.readouterr().out
        assert main([*argv, "--out", str(tmp_path / "fresh"), "--allow-empty"]) == 0
    finally:
        if env_src is not None:
            os.environ["KDA_AITER_SRC"] = env_src


@pytest.mark.parametrize(("strict", "code"), [((), 5), (("--kda-strict",), 4)])
def test_a_marker_that_selects_nothing_says_why(strict: tuple[str, ...], code: int) -> None:
    command = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:randomly", "-m", "gfx950", *strict]
    command += ["--kda-device", "cpu", "--kda-backend", "aiter_default"]
    env = {k: v for k, v in os.environ.items() if k != "KDA_AITER_SRC"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == code, done.stdout[-3000:]
    assert "-m 'gfx950' selected no test" in done.stdout and "device: cpu" in done.stdout
    assert "backend aiter_default: its tests are marked cpu; cannot run here" in done.stdout


def test_skips_are_counted_by_reason() -> None:
    from types import SimpleNamespace

    from kda_conformance.pytest_summary import skip_counts

    def skipped(reason: str) -> SimpleNamespace:
        return SimpleNamespace(longrepr=("conformance/test_x.py", 3, f"Skipped: {reason}"))

    reports = [skipped("no GPU"), skipped("AITER needs a GPU"), skipped("no GPU")]
    assert skip_counts(reports) == {"no GPU": 2, "AITER needs a GPU": 1}


def test_record_lines_keep_whole_numbers_under_a_header() -> None:
    from kda_reports.console import RECORD_LINE_HEADER, record_line

    row = {"case_id": "kda-0123456789ab", "label": "T37 bf16", "backend": "aiter_flashkda_unsegmented",
           "tensor": "o", "verdict": "fail", "max_abs": 4.3512e-3, "budget": 1.0e-3, "ratio": 4.3512,
           "rel_rms": 2e-3, "budget_rel_rms": 1e-3, "rel_rms_ratio": 2.0, "seconds": 0.5}  # fmt: skip
    line = record_line(row)
    assert "4.35e-03" in line and "aiter_flashkda_unsegmented" in line and "…" not in line
    assert len(line) == len(RECORD_LINE_HEADER) and "limit" in RECORD_LINE_HEADER and "rms_ratio" in RECORD_LINE_HEADER


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("raise RuntimeError('no GPU here')", "raised at import: RuntimeError: no GPU here"),
        ("def broken(:\n    pass", "raised at import: SyntaxError"),
        ("import sys\nsys.exit(0)", "called sys.exit(0) at import"),
        (
            "from kda_kernels.registry import register\nfrom kda_kernels.torch_chunk import TorchChunk\n"
            "register('fla_chunk', TorchChunk)",
            "ValueError: a backend named 'fla_chunk' is already registered",
        ),
    ],
    ids=["raises", "syntax", "sys-exit", "takes-a-builtin-name"],
)
def test_a_plugin_that_breaks_at_import_is_one_line_and_exit_2(
    source: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each was a traceback and exit 1 (the code for "a check failed"), or exit 0 with nothing run.
    name = f"kda_broken_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["run", "--device", "cpu", "--plugin", name, "--out", str(tmp_path / "out")])
    output = capsys.readouterr()
    assert code == 2, output
    assert said in output.out + output.err and "Traceback" not in output.out + output.err
    assert registry.get("fla_chunk").name == "fla_chunk", "the built-in keeps its name"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["run", "--growth", "-1"], "argument --growth: --growth must be a finite number > 0, got -1"),
        (["dashboard", "--window", "0"], "argument --window: --window must be an integer >= 1, got 0"),
        (["diff", "a", "b", "--show", "x"], "argument --show"),
    ],
)
def test_an_option_out_of_its_range_is_one_line_and_exit_2(argv: list[str], said: str, capsys) -> None:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2 and said in capsys.readouterr().err


def test_the_options_take_what_a_case_takes_and_run_takes_its_run_id(tmp_path: Path) -> None:
    """--head-dim 50 was refused while --case '{"head_k_dim": 50}' ran; run --run-id, which docs/cli.md lists,
    was refused."""
    argv = ["run", "--device", "cpu", "--backend", "torch_chunk", "--lengths", "9", "--dtypes", "bf16"]
    assert main([*argv, "--head-dim", "50", "--run-id", "k50", "--out", str(tmp_path), "--no-dashboard"]) == 0
    records = pd.read_parquet(tmp_path / "runs" / "k50.parquet")
    assert set(records["case_head_k_dim"]) == {50} and set(records["run_id"]) == {"k50"}


def test_a_plugin_backend_whose_name_is_not_its_registered_name_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    (tmp_path / "kda_misnamed_plugin.py").write_text(
        "from kda_kernels.api import register\n"
        "from kda_kernels.torch_chunk import TorchChunk\n"
        "class Misnamed(TorchChunk):\n    name = 'something_else'\n"
        "register('misnamed', Misnamed)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["run", "--device", "cpu", "--plugin", "kda_misnamed_plugin", "--backend", "misnamed", "--lengths", "9"]
    try:
        assert main([*argv, "--out", str(tmp_path / "out"), "--no-dashboard"]) == 2
    finally:
        registry.unregister("misnamed")
    out = capsys.readouterr().out
    assert "error: backend registered as 'misnamed' names itself 'something_else'" in out and "Traceback" not in out


def test_run_says_each_finding_once_with_its_cases_and_prints_each_record_once(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """One planted bug failed 17 cases and printed 17 FAIL blocks; -v printed every record twice; an error
    printed as FAIL. Now: one block per (backend, check, what went wrong), errors as ERROR."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    argv = ["run", "--device", "cpu", "--plugin", "kda_planted_bugs", "--plugin", "kda_planted_crashes"]
    argv += ["--backend", "planted_nan_at_one_position", "--backend", "planted_raises", "--lengths", "37,64"]
    monkeypatch.setenv("KDA_PLANTED_MESSAGE", "no kernel for this shape")
    assert main([*argv, "-v", "--out", str(tmp_path), "--no-dashboard"]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith(("FAIL ", "ERROR "))]
    assert fails == [
        "FAIL planted_nan_at_one_position, check budget: tensor o not finite [broken]: 9 cases, non-finite values; "
        "the smallest:",
        "ERROR planted_raises, check budget: RuntimeError: no kernel for this shape (at kda_planted_crashes.py:N) "
        "[broken]: 9 cases; the smallest:",
    ], fails
    smallest = out.split(fails[0], 1)[1].splitlines()[1]
    assert "(T37 " in smallest and "first bad: seq 0 token 33" in out
    rows = [line for line in out.splitlines() if line.startswith("kda-") and "planted_nan_at_one_position" in line]
    assert len(rows) == len(set(rows)) == 18, "each record once (9 cases x 2 tensors)"


def test_run_writes_junit_xml_a_ci_reads_whatever_text_a_backend_raised(tmp_path: Path, monkeypatch) -> None:
    import xml.etree.ElementTree as ET

    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("KDA_PLANTED_MESSAGE", "bad \x01 bytes \udcff from a file name")
    argv = ["run", "--device", "cpu", "--plugin", "kda_planted_bugs", "--plugin", "kda_planted_crashes"]
    argv += ["--backend", "planted_nan_at_one_position", "--backend", "planted_raises", "--backend", "torch_chunk"]
    argv += ["--lengths", "37", "--dtypes", "bf16", "--out", str(tmp_path), "--no-dashboard"]
    assert main([*argv, "--junit-xml", str(tmp_path / "junit.xml")]) == 1
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("9", "3", "3")
    failed = next(c for c in suite if c.find("failure") is not None)
    assert failed.get("classname") == "kda.planted_nan_at_one_position.budget"
    properties = {p.get("name"): p.get("value") for p in failed.find("properties")}
    assert properties["worst_ratio"] == "inf" and properties["repro"].startswith("kda-conformance run")
    erred = next(c for c in suite if c.find("error") is not None)
    # A control character is written as an escape by the record itself (recorded_text), before JUnit's writer.
    assert "bad \\x01 bytes \\udcff from a file name" in erred.find("error").get("message")


def test_a_long_sweep_says_how_long_it_expects_before_it_starts_and_what_is_left(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """--lengths 1000000 worked for 3 minutes without a word: past ANNOUNCE_WORK a sweep first probes the
    largest case's shape and says how long it expects; its progress lines say what is left."""
    from kda_conformance.cli import sweep
    from kda_conformance.running import sweep as engine

    monkeypatch.setattr(sweep, "ANNOUNCE_WORK", 2**16)
    monkeypatch.setattr(engine, "PROBE_WORK", (2**20, 2**21))
    argv = ["run", "--device", "cpu", "--backend", "torch_chunk", "--lengths", "300", "--dtypes", "bf16"]
    assert main([*argv, "--out", str(tmp_path), "--no-dashboard"]) == 0
    out = capsys.readouterr().out
    planned = next(line for line in out.splitlines() if line.startswith("planned: "))
    assert "3 case x backend runs, 1217 tokens in all, the largest T300+0+300+17" in planned and "about " in planned
    assert "progress: 3 of 3 case x backend runs, nothing failed" in out and "s left" in out


def test_a_raising_backend_is_an_error_in_the_progress_line_and_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A backend that raised counted as "3 failures" in the progress line and "3 error" in the summary."""
    from kda_conformance.cli.exits import ERRORED

    monkeypatch.syspath_prepend(str(Path(__file__).with_name("plugins")))
    argv = ["run", "--device", "cpu", "--plugin", "kda_planted_crashes", "--backend", "planted_raises"]
    assert main([*argv, "--lengths", "37,64", "--dtypes", "bf16", "--out", str(tmp_path), "--no-dashboard"]) == ERRORED
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if line.startswith("progress: ")][-1]
    summary = next(line for line in out.splitlines() if line.startswith("run ") and ": " in line)
    errors = summary.split(": ", 1)[1]
    assert errors.endswith(" error") and f", {errors}, " in progress, (progress, summary)


def test_a_misspelled_backend_and_an_empty_list_item_are_told_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    from kda_conformance.cli.exits import USAGE

    assert main(["run", "--device", "cpu", "--backend", "torch_chunck"]) == USAGE
    assert "(did you mean 'torch_chunk'?)" in capsys.readouterr().out
    for option, value, said in (("--lengths", "37,,64", "none left empty, got '37,,64'"),
                                 ("--dtypes", "bf16,,fp32", "an empty item not allowed in 'bf16,,fp32'")):  # fmt: skip
        with pytest.raises(SystemExit) as bad:  # argparse's usage error: exit 2 with the option's message
            main(["run", "--device", "cpu", "--backend", "torch_chunk", option, value])
        assert bad.value.code == USAGE and said in capsys.readouterr().err


def test_corpus_without_a_subcommand_prints_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    # It was a bare argparse error, "the following arguments are required: corpus_command".
    assert main(["corpus"]) == 0
    out = capsys.readouterr().out
    assert "usage: kda-conformance corpus" in out and "pin a case, or every failing case of a run file" in out


# The commands that run no kernel, and the top level: none of them may import torch (0.75 s of a 2-core
# machine's start before; `kda-conformance --help` took 1.66 s where it now takes under 0.1 s).
TORCH_FREE = (
    ["--help"],
    ["--version"],
    ["ledger"],
    ["corpus", "list"],
    ["dashboard", "--help"],
    ["diff", "--help"],
    ["shards", "--help"],
    ["autotune", "--help"],
    ["rnu"],  # a misspelled command is told without loading any
)


@pytest.mark.parametrize("argv", TORCH_FREE, ids=" ".join)
def test_the_top_level_and_the_commands_that_run_no_kernel_start_without_torch(argv: list[str]) -> None:
    script = (
        "import contextlib, io, sys\n"
        "from kda_conformance.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n        code = main(sys.argv[1:])\n    except SystemExit as exc:\n        code = exc.code\n"
        "print(code, sorted(m for m in ('torch', 'kda_conformance.running.config') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    code, loaded = done.stdout.strip().split(" ", 1)
    assert loaded == "[]", f"kda-conformance {' '.join(argv)} imported {loaded}: {done.stderr[-2000:]}"
    assert int(code) == (2 if argv == ["rnu"] else 0)


def test_a_command_that_runs_kernels_still_parses_its_own_options_only_when_chosen() -> None:
    """The parser builds one command's options, the others as names: a command's help and errors are whole."""
    from kda_conformance.cli import COMMANDS, build_parser

    lone = build_parser(only="ledger")
    chosen = next(a for a in lone._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {c.name for c in COMMANDS} == set(chosen)
    assert any("--page" in a.option_strings for a in chosen["ledger"]._actions)
    assert not any("--backend" in a.option_strings for a in chosen["run"]._actions)
    whole = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert any("--backend" in a.option_strings for a in whole["run"]._actions)
