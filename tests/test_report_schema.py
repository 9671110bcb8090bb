"""The record schema: records, reports/schema.py and docs/reports.md name the same columns; run files round-trip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from budget_of import budget_check

from kda_cases.case import Case
from kda_conformance.running.truth import case_truth
from kda_kernels import registry
from kda_reports.environment import environment
from kda_reports.runfile import RunRecorder, read_run
from kda_reports.schema import RECORD_COLUMNS, record_rows

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reports.md"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def records() -> list[dict]:
    case = Case(seq_lens=(37,), checkpoints=((0, 5),))
    truth = case_truth(case, CPU)
    return record_rows(budget_check(truth, registry.get("torch_chunk")))


def record_run(rows: list[dict], env: dict, out_dir: Path) -> tuple[pd.DataFrame, dict[str, Path]]:
    recorder = RunRecorder(env, out_dir)
    recorder.add(rows)
    return recorder.finish()


def test_every_column_is_in_the_schema_and_documented(records: list[dict], tmp_path: Path) -> None:
    env = {**environment(CPU), "command": "test", "complete": True}
    frame, _ = record_run([{**row, "test": "node"} for row in records], env, tmp_path)
    assert set(frame.columns) <= set(RECORD_COLUMNS), set(frame.columns) - set(RECORD_COLUMNS)
    documented = DOCS.read_text()
    missing = [name for name in RECORD_COLUMNS if f"| `{name}` |" not in documented]
    assert not missing, f"docs/reports.md does not describe {missing}"
    assert {"o", "final_state", "checkpoint_states"} == set(frame["tensor"])


def test_run_file_round_trips(records: list[dict], tmp_path: Path) -> None:
    frame, paths = record_run(records, {"device_type": "cpu", "complete": True}, tmp_path)
    back = read_run(paths["records"])
    pd.testing.assert_frame_equal(back, frame)
    env = json.loads(paths["environment"].read_text())
    assert env["run_id"] == frame["run_id"].iloc[0] and env["complete"] is True
    assert not list((tmp_path / "runs").glob("*.partial.jsonl"))


def test_killed_run_keeps_its_rows_in_the_partial_file(records: list[dict], tmp_path: Path) -> None:
    recorder = RunRecorder({"device_type": "cpu"}, tmp_path)
    recorder.add(records[:1])
    recorder.add(records[1:])
    back = read_run(recorder.partial)  # as if the process had died before finish()
    assert len(back) == len(records) and set(back["env_complete"]) == {False}
    assert list(back["max_abs"]) == pytest.approx([r["max_abs"] for r in records])


def test_stopped_cli_run_writes_what_it_measured(tmp_path: Path) -> None:
    # SIGTERM (what `timeout` sends) stops the sweep; the run files say it is incomplete.
    script = (
        "import os, signal, sys\n"
        "from kda_conformance import cli\n"
        "from kda_conformance.checks import budget\n"
        "real = budget.run\n"
        "def stop_after_first(truth, backend, params, judge, calls=[]):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2: os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(truth, backend, params, judge)\n"
        "import dataclasses, kda_conformance.checks as checks\n"
        "checks.CHECKS['budget'] = dataclasses.replace(checks.CHECKS['budget'], run=stop_after_first)\n"
        f"sys.exit(cli.main(['run', '--device', 'cpu', '--backend', 'torch_chunk', '--out', {str(tmp_path)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stdout + done.stderr
    (path,) = (tmp_path / "runs").glob("*.parquet")
    frame = read_run(path)
    assert 1 <= frame["case_id"].nunique() < 17 and set(frame["env_complete"]) == {False}


def test_diff_says_whether_two_runs_recorded_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kda_conformance.cli import main

    args = ["run", "--device", "cpu", "--backend", "torch_chunk", "--lengths", "37", "--dtypes", "bf16"]
    for name in ("a", "b"):
        assert main([*args, "--out", str(tmp_path / name), "--no-dashboard"]) == 0
    capsys.readouterr()
    assert main(["diff", "--exact", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "identical: 6 records" in capsys.readouterr().out  # (h0 none, random) x 2 tensors + the packed case
    [changed] = (tmp_path / "b" / "runs").glob("*.parquet")
    frame = read_run(changed)
    frame.loc[0, "max_abs"] *= 1.0000001
    frame.to_parquet(changed, index=False)
    assert main(["diff", "--exact", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "1 records only before" in out and "1 records only after" in out


def test_diff_matches_findings_and_says_how_each_ratio_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs of the same cases under other commands: the same findings, whatever their environment; a
    ratio that moved is listed with both values, a new failure first, and only a new failure exits 1."""
    from kda_conformance.cli import main

    args = ["run", "--device", "cpu", "--backend", "torch_chunk", "--lengths", "37", "--dtypes", "bf16"]
    assert main([*args, "--out", str(tmp_path / "a"), "--no-dashboard"]) == 0
    assert main([*args, "--out", str(tmp_path / "b"), "--no-dashboard", "--seed", "0"]) == 0  # another command
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "6 findings in both runs, 0 changed verdict; 0 only before, 0 only after; 0 new failures" in out
    [changed] = (tmp_path / "b" / "runs").glob("*.parquet")
    frame = read_run(changed)
    frame.loc[0, "rel_rms_ratio"] = frame.loc[0, "rel_rms_ratio"] * 1.38
    frame.loc[1, ["verdict", "ratio"]] = ["fail", 2.5]
    frame.to_parquet(changed, index=False)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--env"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "1 changed verdict" in lines[0] and "1 new failures or errors" in lines[0]
    assert lines[1].endswith("of the limit") and ": pass -> fail, " in lines[1] and "-> 2.5 of the limit" in lines[1]
    assert ": pass -> pass, 0.5 -> 0.69 of the limit" in lines[2]
    assert any(line.startswith("environment env_command: ") for line in lines)


def test_the_environment_records_what_moves_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    from kda_reports.environment import environment

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    monkeypatch.setenv("KDA_PROFILE", "ci")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere")  # a path: no number moves with it
    monkeypatch.setenv("KDA_SUITE_COMMIT", "abc123")
    env = environment(CPU)
    variables = json.loads(str(env["variables"]))
    assert variables["TRITON_F32_DEFAULT"] == "ieee" and variables["KDA_PROFILE"] == "ci"
    assert "TRITON_CACHE_DIR" not in variables and "KDA_SUITE_COMMIT" not in variables
    assert env["suite_commit"] == "abc123" and env["suite_commit_from"] == "KDA_SUITE_COMMIT"
    # An allow-list, not prefixes alone: what moves CPU numerics is in, a credential's value is not.
    monkeypatch.setenv("FLA_API_KEY", "s3cret")
    monkeypatch.setenv("KDA_SECRET_TOKEN", "s3cret")
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    variables = json.loads(str(environment(CPU)["variables"]))
    assert variables["FLA_API_KEY"] == variables["KDA_SECRET_TOKEN"] == "<redacted>"
    assert variables["MKL_CBWR"] == "AVX2" and variables["ATEN_CPU_CAPABILITY"] == "avx2"
    # Secrets by other names, and a URL's credentials in a value that is recorded.
    for name in ("KDA_DB_PASS", "FLA_PAT", "KDA_BEARER", "CUDA_PASSPHRASE", "TRITON_CREDS"):
        monkeypatch.setenv(name, "s3cret")
    monkeypatch.setenv("TRITON_REMOTE_CACHE", "redis://admin:s3cret@cache.example:6379/0")
    monkeypatch.setenv("TRITON_PATTERN_MATCH", "1")  # PAT inside a word: no secret
    recorded = str(environment(CPU)["variables"])
    assert "s3cret" not in recorded
    variables = json.loads(recorded)
    assert variables["TRITON_REMOTE_CACHE"] == "redis://<redacted>@cache.example:6379/0"
    assert variables["TRITON_PATTERN_MATCH"] == "1" and variables["KDA_DB_PASS"] == "<redacted>"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "model name" in cpuinfo.read_text():
        assert env["device_name"] not in ("x86_64", "aarch64", ""), "the CPU's model, not its architecture"


# One value per shape in SECRET_SHAPES, as it would be pasted into a variable of an innocent name; the
# secret part (which must not survive) and what stays.
SHAPED = {
    "GitHub token": ("ghp_" + "a1B2" * 9, "ghp_" + "a1B2" * 9, ""),
    "GitLab token": ("glpat-" + "x9" * 10, "glpat-" + "x9" * 10, ""),
    "Hugging Face token": ("hf_" + "Ab3" * 11, "Ab3" * 11, ""),
    "API key (sk-)": ("sk-" + "q7" * 12, "q7" * 12, ""),
    "AWS access key": ("AKIAIOSFODNN7EXAMPLE", "IOSFODNN7EXAMPLE", ""),
    "Slack token": ("xoxb-123456789012-abcdef", "123456789012", ""),
    "JSON web token": ("eyJhbGciOiJI.eyJzdWIiOiIx.SflKxwRJSMeKKF2QT4f", "SflKxwRJSMeKKF2QT4f", ""),
    "authorization header": ("Authorization: Bearer abcdefgh.ijk", "abcdefgh.ijk", "Authorization: Bearer "),
    "secret parameter": ("https://cache.example/x?a=1&api_key=hunter22&b=2", "hunter22", "a=1&api_key=<"),
    "private key": ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "MIIEow", ""),
    "Slack webhook": ("https://hooks.slack.com/services/T0001/B0002/XyZ123abc", "XyZ123abc", "hooks.slack.com/"),
    "PyPI token": ("pypi-AgEIcHlwaS5vcmc" + "Q7x" * 15, "Q7xQ7xQ7x", ""),
    "npm token": ("npm_" + "aB3" * 12, "aB3aB3", ""),
    "Google API key": ("AIza" + "SyD-9" * 7, "SyD-9", ""),
    "Azure SAS signature": ("https://a.blob.core.windows.net/c?sv=2022&sig=Zm9vYmFy%2B&se=1", "Zm9vYmFy", "&sig=<"),
    "secret option": ("train --password hunter2/@x --steps 3", "hunter2", "--password <redacted> --steps 3"),
    "JSON or YAML secret": ('{"db_password": "hunter2", "n": 1}', "hunter2", '"db_password": "<redacted>"'),
}


@pytest.mark.parametrize("shape", list(SHAPED))
def test_a_credential_is_redacted_by_its_shape_whatever_its_variable(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kda_conformance.running.config import build_config
    from kda_reports.environment import SECRET_SHAPES

    assert set(SHAPED) == set(SECRET_SHAPES)
    value, secret, kept = SHAPED[shape]
    monkeypatch.setenv("TRITON_REMOTE_CACHE_URL", value)  # a name that says nothing of a secret
    recorded = json.loads(str(environment(CPU)["variables"]))["TRITON_REMOTE_CACHE_URL"]
    assert secret not in recorded and "<redacted>" in recorded and kept in recorded, recorded
    # A command line records it no more than a variable does.
    config = build_config(device="cpu", backends=["torch_chunk"], command=f"kda-conformance run --note {value}")
    assert secret not in config.environment()["command"]


@pytest.mark.parametrize(
    "value", ["ieee", "/home/ci/.triton/cache", "bypass=1", "0123456789abcdef0123456789abcdef01234567", "tf32"]
)
def test_an_ordinary_value_is_recorded_as_it_is(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_REMOTE_CACHE_URL", value)  # a commit, a path, a flag: no credential shape
    assert json.loads(str(environment(CPU)["variables"]))["TRITON_REMOTE_CACHE_URL"] == value


def test_the_suites_commit_is_its_own_checkouts_or_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from a folder inside another git repository, the records carried that repository's commit."""
    from kda_reports import environment

    monkeypatch.delenv("KDA_SUITE_COMMIT", raising=False)
    outer = tmp_path / "other-project"
    inside = outer / "vendor" / "kda-conformance"
    inside.mkdir(parents=True)
    for args in (
        ["init", "-q"],
        ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"],
    ):
        subprocess.run(["git", *args], cwd=outer, check=True, capture_output=True)
    monkeypatch.setattr(environment, "_REPO", inside.resolve())
    monkeypatch.setattr(environment, "_installed_commit", lambda: "")
    assert environment.suite_commit() == ("unknown", "unknown")
    monkeypatch.setattr(environment, "_REPO", outer.resolve())  # the project's own checkout
    commit, source = environment.suite_commit()
    assert source == "git" and len(commit) == 12


def test_detections_verdict_is_one_line_with_its_counts() -> None:
    # detection printed 408 lines and its verdict only in its exit code.
    from kda_reports.detection import detection_verdict

    table = pd.DataFrame(
        {"backend": ["planted_a", "planted_b", "torch_chunk"], "caught by": ["budget (1)", "nothing", "nothing"]}
    )
    said = detection_verdict(table, planted={"planted_a", "planted_b"})
    assert said == "caught 1 of 2 planted bugs; false alarms on 0 of 1 correct backend"


def test_detections_worst_ratio_leaves_out_the_records_the_ledger_claims() -> None:
    # FLA's chunk kernel's worst ratio read inf in the CPU detection run: its in-place cu_seqlens records, a
    # known bug of FLA's, not the kernel's margin on the cases it computes.
    from kda_reports.detection import worst_ratio_of

    records = pd.DataFrame(
        {
            "backend": ["fla_chunk"] * 3 + ["torch_chunk"],
            "verdict": ["pass", "marginal", "known", "pass"],
            "ratio": [0.5, 1.19, float("inf"), 0.6],
            "rel_rms_ratio": [0.4, 1.0, float("inf"), 0.2],
        }
    )
    assert worst_ratio_of(records, "fla_chunk") == "1.19 (1 known left out)"
    assert worst_ratio_of(records, "torch_chunk") == "0.6"
    assert worst_ratio_of(records, "absent") == "-"
