"""The CI templates a team copies (ci-templates/, docs/ci.md): each passes the schema of its CI system
(check-jsonschema's vendored GitHub-workflow and Buildkite schemas), and each job's shell steps run end to end
on the CPU: two shard jobs write their parts (the GPU replaced by ``--device cpu``, a small profile, the baseline
beside a planted bug), the parts are moved as the CI system moves artifacts, and the merge job builds one store,
the dashboard, the findings page and the tracking issue's text. Installing and posting are the steps left out:
the test's own environment is the install, and the issue's text is written to a file, not posted."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from suite_paths import ENV, REPO

yaml = pytest.importorskip("ruamel.yaml", reason="ruamel.yaml comes with check-jsonschema (pip install -e '.[dev]')")

TEMPLATES = REPO / "ci-templates"
NIGHT = {
    "KDA_DEVICE": "cpu",
    "KDA_NIGHTLY_ARGS": "--profile smoke --examples 1 --workers 1 --backend torch_chunk "
    "--backend planted_transposed_state",
    "KDA_PLUGIN_ARGS": "--plugin kda_planted_bugs",
}
LEFT_OUT = {"install", "post-issue"}  # the test's environment is the install; the issue is not posted


def _load(path: Path) -> dict:
    return yaml.YAML(typ="safe").load(path.read_text())


def _runner(tmp: Path, name: str) -> Path:
    """A job's working folder, with the suite's virtual environment where the steps look for it."""
    folder = tmp / name
    folder.mkdir()
    (folder / ".venv").symlink_to(Path(sys.prefix))
    return folder


def _run(script: str, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-c", script], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    "schema, files", [("vendor.github-workflows", ["github/kda-amd-ci.yml", "github/kda-nightly.yml"]),
                      ("vendor.buildkite", ["buildkite/kda-nightly.yml"])],
)  # fmt: skip
def test_each_template_passes_its_ci_systems_schema(schema: str, files: list[str]) -> None:
    checker = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    if checker is None:
        pytest.skip("check-jsonschema is not installed (pip install -e '.[dev]')")
    done = subprocess.run(
        [checker, "--builtin-schema", schema, *(str(TEMPLATES / f) for f in files)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_the_github_nightly_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    workflow = _load(TEMPLATES / "github" / "kda-nightly.yml")
    env = {**ENV, **{k: str(v) for k, v in workflow["env"].items()}, **NIGHT, "KDA_RUN_ID": "ci-night"}
    shard_job, merge_job = workflow["jobs"]["shard"], workflow["jobs"]["merge"]
    shards = shard_job["strategy"]["matrix"]["shard"]
    assert len(shards) == int(env["KDA_SHARDS"]), "the matrix has as many shards as KDA_SHARDS says"
    merge = _runner(tmp_path, "merge")
    named: list[str] = []  # each shard job's log
    for shard in shards:
        folder = _runner(tmp_path, f"shard-{shard}")
        said = ""
        for step in shard_job["steps"]:
            if "run" in step and step.get("id") not in LEFT_OUT:
                done = _run(step["run"], folder, {**env, "KDA_SHARD": str(shard)})
                # A night with a failure exits 1 and its part is still uploaded (if: always()).
                assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
                said += done.stdout
        # The job's log and its night file say what the shard holds (pytest-xdist's own log cannot).
        held = f"shard {shard}/{len(shards)}: "
        night = json.loads((folder / "store" / "runs" / f"ci-night.s{shard}of{len(shards)}.night.json").read_text())
        assert night["shard"].startswith(held) and held in said, (night.get("shard"), said[-2000:])
        named.append(said)
        upload = next(s for s in shard_job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
        assert upload["if"] == "always()" and upload["with"]["path"] == "store/runs"
        uploads = [s["with"]["path"] for s in shard_job["steps"] if s.get("uses", "").startswith("actions/upload")]
        assert uploads == ["store/runs", "store/autotune"]  # the autotune choices too, for --autotune-replay
        # download-artifact with a pattern puts each artifact in a folder of its name
        shutil.copytree(folder / "store" / "runs", merge / "parts" / f"kda-store-{shard}")
    for step in merge_job["steps"]:
        if "run" in step and step.get("id") not in LEFT_OUT:
            done = _run(step["run"], merge, env)
            assert done.returncode == 0, (step.get("id"), done.stdout[-3000:] + done.stderr[-3000:])
    store = merge / "store"
    parts = sorted(p.name for p in (store / "runs").glob("*.parquet"))
    assert parts == ["ci-night.s1of2.parquet", "ci-night.s2of2.parquet"], parts
    assert (store / "dashboard.html").exists() and (merge / "site" / "findings.md").exists()
    issue = (store / "issue.md").read_text()
    assert re.match(r"\d+ new findings? in runs ci-night", issue) and "planted_transposed_state" in issue, issue[:500]
    assert "## Repro" in issue
    # The planted bug's failed tests are named in a shard's log as they fail, before pytest's summary (a job
    # killed from outside writes none).
    failing = [log for log in named if "kda-conformance: FAILED conformance/" in log]
    assert failing and all(
        log.index("kda-conformance: FAILED conformance/") < log.index("short test summary info") for log in failing
    ), [log[-2000:] for log in named]


@pytest.mark.slow
def test_the_buildkite_nightly_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    pipeline = _load(TEMPLATES / "buildkite" / "kda-nightly.yml")
    env = {**ENV, **{k: str(v) for k, v in pipeline["env"].items()}, **NIGHT, "BUILDKITE_BUILD_NUMBER": "7"}
    shard_step, merge_step = (next(s for s in pipeline["steps"] if s.get("key") == key) for key in ("shards", "merge"))
    runtime = {"python3 -m venv", "buildkite-agent artifact download"}  # the install, and the artifact move below

    def commands(step: dict) -> str:
        # `$$` is Buildkite's deferral to the job's shell; the lines left out are done here instead.
        lines = step["command"].replace("$$", "$").splitlines()
        return "\n".join(line for line in lines if not any(line.startswith(r) for r in runtime))

    merge = _runner(tmp_path, "merge")
    for job in range(shard_step["parallelism"]):
        folder = _runner(tmp_path, f"job-{job}")
        count = str(shard_step["parallelism"])
        done = _run(commands(shard_step), folder, {**env, "BUILDKITE_PARALLEL_JOB": str(job),
                                                  "BUILDKITE_PARALLEL_JOB_COUNT": count})  # fmt: skip
        assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
        # The shard's part of the store, and the autotune choices its processes made (for --autotune-replay).
        assert shard_step["artifact_paths"] == ["store/runs/*", "store/autotune/**/*"]
        shutil.copytree(folder / "store" / "runs", merge / "store" / "runs", dirs_exist_ok=True)
    done = _run(commands(merge_step), merge, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    store = merge / "store"
    assert sorted(p.name for p in (store / "runs").glob("*.parquet")) == ["nightly-7.s1of2.parquet",
                                                                          "nightly-7.s2of2.parquet"]  # fmt: skip
    for artifact in merge_step["artifact_paths"]:
        assert (merge / artifact).exists(), artifact


def test_the_amd_ci_job_runs_its_tests_and_writes_the_junit_file(tmp_path: Path) -> None:
    """Its one shell step, with the marker and backend narrowed to what a CPU runs in seconds."""
    workflow = _load(TEMPLATES / "github" / "kda-amd-ci.yml")
    job = workflow["jobs"]["gfx950"]
    [test] = [s for s in job["steps"] if s.get("id") == "test"]
    assert "--kda-strict" in test["run"] and workflow["env"]["KDA_MARK"] == "gfx950"
    folder = _runner(tmp_path, "runner")
    os.symlink(REPO, folder / "kda-conformance")
    narrowed = "--kda-backend torch_chunk --kda-profile smoke -k test_within_budget -p no:cacheprovider"
    env = {**ENV, **{k: str(v) for k, v in workflow["env"].items()}, "KDA_DEVICE": "cpu", "KDA_MARK": "cpu",
           "KDA_PYTEST_ARGS": narrowed, "GITHUB_WORKSPACE": str(folder)}  # fmt: skip
    done = _run(test["run"], folder, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (folder / "kda-report" / "junit.xml").exists()
