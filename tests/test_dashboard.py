"""The run store, regression detection, the dashboard (in a real headless Chromium), the nightly command, and
process isolation (a backend that segfaults and one that hangs cost their own cases only)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from suite_paths import ENV, PLUGINS, REPO

from kda_conformance.cli import main
from kda_conformance.cli.exits import ERRORED
from kda_reports.dashboard import build_dashboard
from kda_reports.regressions import find_regressions
from kda_reports.runfile import RunRecorder, atomic_write, read_run, write_run
from kda_reports.store import load_store

ARTIFACTS = Path(os.environ.get("KDA_ARTIFACTS", REPO / "out" / "artifacts"))
NIGHTS = 5
RUN = [sys.executable, "-m", "kda_conformance.cli", "run"]


@pytest.fixture(scope="module")
def one_run(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    out = tmp_path_factory.mktemp("seed-run")
    argv = ["run", "--backend", "torch_chunk", "--device", "cpu", "--lengths", "20,40", "--dtypes", "bf16,fp32"]
    assert main([*argv, "--out", str(out)]) == 0
    return read_run(next((out / "runs").glob("*.parquet")))


def planted_group(frame: pd.DataFrame) -> pd.Series:
    """The rows the planted regression hits: fp32 outputs."""
    return (frame["case_dtype"] == "fp32") & (frame["tensor"] == "o")


@pytest.fixture(scope="module")
def history(one_run: pd.DataFrame, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five nights of the same run; on the last the fp32 outputs' error grows 20 times and fails, and the
    suite's commit changes."""
    store = tmp_path_factory.mktemp("store")
    for night in range(NIGHTS):
        frame = one_run.copy()
        run_id = f"2026111{night}T020000Z-night{night}"
        env = {"date": f"2026-11-1{night}T02:00:00+00:00", "suite_commit": "abc" if night < NIGHTS - 1 else "def"}
        env |= {"run_id": run_id, "complete": True, "device_name": "cpu", "fla": "0.6.0"}
        for key, value in env.items():
            frame[f"env_{key}"] = value
        frame["run_id"] = run_id
        if night == NIGHTS - 1:
            hit = planted_group(frame)
            for column in ("max_abs", "rel_rms", "ratio", "rel_rms_ratio"):
                frame.loc[hit, column] *= 20
            frame.loc[hit, "verdict"] = "fail"
        write_run(frame, env, store, run_id)
    return store


def test_store_loads_every_night_and_names_broken_files(history: Path, tmp_path: Path) -> None:
    broken = tmp_path / "store"
    shutil.copytree(history, broken)
    (broken / "runs" / "20261120T000000Z-corrupt.parquet").write_bytes(b"PAR1 not really")
    torn = broken / "runs" / "20261121T000000Z-killed.partial.jsonl"
    torn.write_text('{"case_id": "c", "verdict": "pass", "backend": "torch_chunk"}\n{"case_id": "c", "verd')
    store = load_store(broken)
    assert len(store.runs) == NIGHTS + 1  # the killed run's whole line is kept, marked incomplete
    assert any("corrupt.parquet: not readable" in p for p in store.problems)
    assert any("killed.partial.jsonl: 1 line(s) skipped: unreadable (torn" in p for p in store.problems)
    assert not store.records[store.records["run_id"].str.endswith("killed")]["env_complete"].any()


def test_a_killed_write_leaves_no_half_file_and_keeps_earlier_runs(history: Path, tmp_path: Path) -> None:
    target = tmp_path / "runs" / "20261130T000000Z-x.parquet"
    target.parent.mkdir()

    def dies_midway(path: Path) -> None:
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, dies_midway)
    assert not target.exists()
    recorder = RunRecorder({"date": "2026-11-30"}, tmp_path)
    recorder.add([{"case_id": "c", "backend": "b", "verdict": "pass", "tensor": "o"}])  # then the process dies
    store = load_store(tmp_path)
    assert list(store.runs["run_id"]) == [recorder.run_id] and not store.records["env_complete"].any()
    assert len(load_store(history).runs) == NIGHTS


def test_rows_that_are_not_records_are_named_and_skipped(history: Path, tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    shutil.copytree(history, store_dir)
    odd = store_dir / "runs" / "20261122T000000Z-odd.partial.jsonl"
    good = '{"case_id": "kda-1", "backend": "torch_chunk", "verdict": "pass", "tensor": "o", "ratio": 0.5}'
    odd.write_text(f'null\n{good}\n{{"backend": "torch_chunk"}}\n{{"case_id": "c", "backend": "b", "verdict": "ok"}}\n')
    (store_dir / "runs" / "20261123T000000Z-foreign.parquet").write_bytes(b"")
    pd.DataFrame({"colour": ["red"]}).to_parquet(store_dir / "runs" / "20261124T000000Z-foreign.parquet")
    env = next((store_dir / "runs").glob("*night0.env.json"))
    env.write_text(env.read_text()[:25])  # torn
    store = load_store(store_dir)
    problems = "\n".join(store.problems)
    assert "odd.partial.jsonl: 1 line(s) skipped: JSON, but not a record" in problems
    assert "odd.partial.jsonl: 1 row(s) skipped: no case_id" in problems
    assert "odd.partial.jsonl: 1 row(s) skipped: a verdict that is not one of pass, fail" in problems
    assert "foreign.parquet: not a run's records (no case_id, backend, verdict column)" in problems
    assert f"{env.name}: not readable (JSONDecodeError: Unterminated string" in problems
    assert all(not p.endswith(("-", "'")) for p in store.problems)
    assert len(store.records[store.records["run_id"].str.endswith("odd")]) == 1
    assert main(["dashboard", "--store", str(store_dir)]) == 0


def test_a_store_that_is_not_there_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboard", "--store", str(tmp_path / "mistyped")]) == 2
    assert "--store: the store" in capsys.readouterr().out and not (tmp_path / "mistyped").exists()


@pytest.mark.slow
def test_concurrent_dashboard_rebuilds_all_succeed(history: Path, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    store = load_store(history)
    with ThreadPoolExecutor(9) as pool:
        built = list(pool.map(lambda _: build_dashboard(store, tmp_path / "dashboard.html")[0], range(9)))
    assert len(built) == 9 and (tmp_path / "dashboard.html").stat().st_size > 20_000
    assert (tmp_path / "plotly.min.js").stat().st_size > 1_000_000, "the page's script, whole, beside it"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary file left behind"


def test_a_run_in_progress_is_told_from_one_that_died(tmp_path: Path) -> None:
    row = {"case_id": "c", "backend": "b", "verdict": "pass", "tensor": "o"}
    live = RunRecorder({"date": "2026-11-30"}, tmp_path / "live")
    live.add([row])
    assert any("a run in progress" in p for p in load_store(tmp_path / "live").problems)
    died = tmp_path / "died"
    code = (
        "import os, sys; from kda_reports.runfile import RunRecorder; "
        f"r = RunRecorder({{'date': '2026-11-30'}}, sys.argv[1]); r.add([{row!r}]); os._exit(9)"
    )
    subprocess.run([sys.executable, "-c", code, str(died)], check=False, timeout=120)
    assert any("a run that did not finish" in p for p in load_store(died).problems)
    live.finish()
    assert not load_store(tmp_path / "live").problems


def test_regressions_flag_the_planted_one_with_its_cause(history: Path) -> None:
    store = load_store(history)
    flags = find_regressions(store.records, store.runs)
    assert len(flags) >= 1 and set(flags["tensor"]) == {"o"}
    assert all(" fp32 " in f" {family} " for family in flags["family"])
    assert set(flags["kind"]) == {"new failure"}
    assert flags["cause"].str.contains("suite: abc -> def").all()
    assert flags["repro"].str.startswith("kda-conformance run --device cpu --backend torch_chunk --case").all()
    quiet = find_regressions(store.records[store.records["run_id"] != store.runs["run_id"].iloc[-1]], store.runs[:-1])
    assert quiet.empty


def test_the_page_loads_plotly_once_from_beside_it_and_stays_small(history: Path, tmp_path: Path) -> None:
    """Plotly's 4.8 MB script inlined made the H200 night's page 5.7 MB; loaded from plotly.min.js beside the
    page, that page is 0.85 MB (2026-12-04)."""
    page, _ = build_dashboard(load_store(history), tmp_path / "site" / "dashboard.html")
    text = page.read_text()
    assert text.count('src="plotly.min.js"') == 1 and "Plotly.newPlot" in text
    script = page.with_name("plotly.min.js")
    assert script.stat().st_size > 10 * len(text) and page.stat().st_size < 2 * 2**20
    before = script.stat().st_mtime_ns
    build_dashboard(load_store(history), page)  # a second page in the folder shares the one copy
    assert script.stat().st_mtime_ns == before


def chromium() -> str:
    """A headless Chromium: ``KDA_BROWSER``, else ``chromium`` or ``chromium-browser`` on the PATH. A test does
    not install system packages: without one, the test skips and says how to get one."""
    path = os.environ.get("KDA_BROWSER") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no headless Chromium: install one (Debian: apt-get install chromium) or set KDA_BROWSER")
    return path


def test_dashboard_renders_in_a_real_browser(history: Path, tmp_path: Path) -> None:
    page, regressions = build_dashboard(load_store(history), tmp_path / "dashboard.html")
    assert not regressions.empty
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
    flags += ["--virtual-time-budget=15000"]
    browser = chromium()
    done = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180, check=False
    )
    dom = done.stdout
    # Plotly draws each plot into SVG once its script has run: both plots must be there.
    assert dom.count('class="main-svg"') >= 2, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    table = re.search(r'<table id="regressions">.*?</table>', dom, flags=re.S)
    assert table and "new failure" in table.group(0) and "fp32" in table.group(0) and "torch_chunk" in table.group(0)
    # The first screen answers "is tonight green, and if not, what broke?"; counts coloured by verdict.
    status = re.search(r"<p id=.status. class=.(\w+).>(.*?)</p>", dom)
    assert status and status.group(1) == "fail" and status.group(2).startswith("Red: last complete run"), status
    new = "; 2 new failure(s), the first torch_chunk budget fp32 typical T&lt;="
    assert new in status.group(2) and ": kda-conformance run --device cpu --backend torch_chunk" in status.group(2)
    per_backend = re.search(r'<table id="per-backend">.*?</table>', dom, flags=re.S).group(0)
    assert 'class="num fail"' in per_backend and 'class="num pass"' in per_backend
    worst = re.search(r'<table id="worst">.*?</table>', dom, flags=re.S).group(0)
    assert "<th>check</th>" in worst and "<th>subject</th>" in worst
    environment = re.search(r'<table id="environment">.*?</table>', dom, flags=re.S).group(0)
    assert ">nan<" not in environment
    assert "No sentinel ran in these runs" in dom  # a note, not an empty plot
    assert f"2026-11-1{NIGHTS - 1} 02:00 2026111{NIGHTS - 1}T020000Z-night{NIGHTS - 1}" in dom  # one category a night
    for width, name in ((420, "dashboard-narrow.png"), (1400, "dashboard-wide.png")):
        screenshot = ARTIFACTS / name
        size = [f"--window-size={width},3000"]
        shot = subprocess.run(
            [browser, *flags, *size, f"--screenshot={screenshot}", page.as_uri()], capture_output=True, timeout=180
        )
        assert screenshot.exists() and screenshot.stat().st_size > 10_000, shot.stderr[-2000:]


@pytest.mark.slow
def test_nightly_command_adds_a_run_and_rebuilds_the_dashboard(tmp_path: Path) -> None:
    """Two nights: each compiles its kernel configurations up front (--compile on: on a CPU it is otherwise
    off), keeps Triton's cache beside the store, and writes its night file; the dashboard shows each night's
    time per backend and the trend of the nights' wall time."""
    argv = ["nightly", "--store", str(tmp_path), "--profile", "smoke", "--examples", "1", "--compile", "on"]
    assert main([*argv, "--backend", "torch_chunk", "--device", "cpu"]) == 0
    assert main([*argv, "--backend", "torch_chunk", "--device", "cpu", "--workers", "2"]) == 0
    store = load_store(tmp_path)
    assert len(store.runs) == 2 and (tmp_path / "dashboard.html").stat().st_size > 20_000
    assert not store.problems, store.problems  # --workers 2 is a number in the night file, read as one
    assert len(store.nights) == 2 and (store.nights["compile_seconds"] > 0).all()
    for night_file in (tmp_path / "runs").glob("*.night.json"):
        night = json.loads(night_file.read_text())
        assert night["cache"]["dir"].endswith("triton-cache")
        assert night["compile"]["outcomes"] == {"compiled": night["kernel_configs"]}
        timing_file = night_file.with_name(night_file.name.replace(".night.", ".timing."))
        timing = json.loads(timing_file.read_text())
        assert timing["seconds"]["compile"] == night["compile"]["seconds"] > 0
        assert timing["calls"]["compile"] == night["compile"]["jobs"]
        assert timing["compile_wall_seconds"] == night["compile"]["wall_seconds"]
        # Written once, by the pytest session, before the night file: the night does not rewrite it.
        assert timing_file.stat().st_mtime_ns <= night_file.stat().st_mtime_ns
    page = (tmp_path / "dashboard.html").read_text()
    assert 'id="night-time"' in page and "night-walls" in page and "coverage-by-backend" in page
    assert "The night's wall time (minutes)" in page


@pytest.mark.slow
def test_an_interrupted_nightly_keeps_what_ran_and_shows_it(tmp_path: Path, interruptible: dict) -> None:
    """Ctrl-C (or a CI job's time limit) in the middle of a night: no traceback, exit 130, the part of the
    night that ran is in the store and on the dashboard. A hanging backend keeps the night from ending."""
    command = [sys.executable, "-m", "kda_conformance.cli", "nightly", "--store", str(tmp_path), "--device", "cpu"]
    command += ["--profile", "smoke", "--examples", "1", "--workers", "2", "--plugin", "kda_planted_crashes"]
    command += ["--backend", "torch_chunk", "--backend", "planted_hang"]
    env = ENV
    night = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             **interruptible)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not any((tmp_path / "runs").glob("*.partial.jsonl")) and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(5)
        os.killpg(night.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
        output, _ = night.communicate(timeout=300)
    finally:
        if night.poll() is None:
            os.killpg(night.pid, signal.SIGKILL)
    assert night.returncode == 130, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    records = load_store(tmp_path).records
    assert (records[records["backend"] == "torch_chunk"]["verdict"] == "pass").any()
    assert (tmp_path / "dashboard.html").stat().st_size > 20_000


@pytest.mark.slow
def test_a_crashing_and_a_hanging_backend_cost_their_cases_only(tmp_path: Path) -> None:
    cases = [arg for case in ('{"seq_lens": [37]}', '{"seq_lens": [64], "dtype": "fp32"}') for arg in ("--case", case)]
    backends = [arg for b in ("planted_segfault", "planted_hang", "torch_chunk") for arg in ("--backend", b)]
    isolated = ["--device", "cpu", "--isolate", "--case-timeout", "5", "--plugin", "kda_planted_crashes"]
    done = subprocess.run(
        [*RUN, *isolated, *backends, *cases, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(PLUGINS)},
        check=False,
    )
    assert done.returncode == ERRORED, done.stdout[-3000:]  # nothing failed; two backends erred
    frame = read_run(next((tmp_path / "runs").glob("*.parquet")))
    by_backend = {b: part for b, part in frame.groupby("backend")}
    assert set(by_backend["planted_segfault"]["verdict"]) == {"error"}
    assert by_backend["planted_segfault"]["reason"].str.contains("died (signal SIGSEGV)", regex=False).all()
    assert by_backend["planted_hang"]["reason"].str.contains("no result within 5 s").all()
    assert set(by_backend["torch_chunk"]["verdict"]) == {"pass"} and by_backend["torch_chunk"]["case_id"].nunique() == 2
    assert frame[frame["verdict"] == "error"]["repro"].str.startswith("kda-conformance run --device cpu").all()


def _nights(worst: list[float], failed: list[bool]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A tiny history: one backend, one case family, one tensor, a row per night."""
    rows = [
        {
            "run_id": f"n{i}",
            "backend": "k",
            "tensor": "o",
            "case_id": "c",
            "case_seq_lens": "64",
            "case_dtype": "bf16",
            "case_gate_regime": "typical",
            "verdict": "fail" if bad else "pass",
            "ratio": ratio,
            "rel_rms_ratio": ratio / 2,
            "repro": "kda-conformance run ...",
            "env_fla": "0.6.0" if i < len(worst) - 1 else "0.6.1",
        }
        for i, (ratio, bad) in enumerate(zip(worst, failed, strict=True))
    ]
    runs = pd.DataFrame({"run_id": [f"n{i}" for i in range(len(worst))], "env_fla": [r["env_fla"] for r in rows]})
    return pd.DataFrame(rows), runs


@pytest.mark.parametrize(
    ("worst", "failed", "kind"),
    [
        ([0.3, 0.3, 0.3, 1.4], [False, False, False, True], "new failure"),
        ([0.3, 0.3, 1.4, 0.3], [False, False, True, False], "fixed"),
        ([0.2, 0.2, 0.2, 0.5], [False] * 4, "error growth"),
        ([0.2, 0.2, 0.2, 0.25], [False] * 4, None),
        ([0.01, 0.01, 0.01, 0.05], [False] * 4, None),  # below the noise floor
    ],
)
def test_regression_kinds_and_environment_cause(worst: list[float], failed: list[bool], kind: str | None) -> None:
    records, runs = _nights(worst, failed)
    flags = find_regressions(records, runs)
    assert list(flags["kind"]) == ([kind] if kind else [])
    if kind:
        assert flags["cause"].iloc[0] == "environment: fla 0.6.0 -> 0.6.1"


def test_a_new_kernel_shape_is_not_judged_against_another_shapes_history() -> None:
    records, runs = _nights([0.3, 0.3, 0.3, 1.4], [False, False, False, True])
    records["case_head_k_dim"] = records["case_head_v_dim"] = [64, 64, 64, 16]
    flags = find_regressions(records, runs)
    # Not "new failure ... no change of environment or suite" against K = 64's history: a family of its own,
    # new tonight, whatever else changed (a backend added on night 2 was blamed on the environment).
    assert list(flags["kind"]) == ["new"] and "not measured in the run before" in flags["cause"].iloc[0]
    assert "K16V16" in flags["family"].iloc[0]


def test_a_seed_change_is_named_as_a_cause() -> None:
    records, runs = _nights([0.2, 0.2, 0.2, 0.5], [False] * 4)
    records["env_fla"] = runs["env_fla"] = "0.6.0"
    records["env_seed"] = [1.0, 1.0, 1.0, 2.0]
    flags = find_regressions(records, runs)
    assert list(flags["kind"]) == ["error growth"] and flags["cause"].iloc[0] == "seed: 1 -> 2 (other cases drawn)"


def test_a_sentinel_flags_an_error_grown_within_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose error grew 1.4 times passes the budget rule; against three correct nights, the
    sentinel's trend flags it after one night."""
    from kda_cases.sentinels import SENTINEL_GROWTH, load_sentinels

    monkeypatch.syspath_prepend(str(PLUGINS))
    sentinel = min((c for c in load_sentinels() if c.dtype == "fp32"), key=lambda c: c.total_tokens)
    argv = ["run", "--plugin", "kda_behaviours", "--backend", "test_drifting_error", "--device", "cpu"]
    argv += ["--case", sentinel.to_json(), "--out", str(tmp_path), "--no-dashboard"]
    for scale in ("1", "1", "1", "1.4"):
        monkeypatch.setenv("KDA_TEST_ERROR_SCALE", scale)
        assert main(argv) == 0, "within budget every night"
    store = load_store(tmp_path)
    assert set(store.records["verdict"]) == {"pass"}
    flags = find_regressions(store.records, store.runs)
    grown = flags[flags["kind"] == "sentinel growth"]
    assert len(grown) >= 1 and set(grown["case_id"]) == {sentinel.id}
    assert (grown["tonight"] / grown["before"]).between(SENTINEL_GROWTH, 1.5).all()
    assert main(["dashboard", "--store", str(tmp_path)]) == 0
    assert "Sentinels: the same inputs every night" in (tmp_path / "dashboard.html").read_text()


def test_a_quick_run_is_shown_as_a_run_with_its_failures_ringed_in_its_series_colours(
    one_run: pd.DataFrame, tmp_path: Path
) -> None:
    """One CPU run read as a night: a one-point trend, "The night's time", NOT REACHED 12/40. Now a run is a run
    (a night is what kda-conformance nightly wrote), one run draws no trend, and a failing point is ringed."""
    from kda_reports.dashboard import PALETTE, error_vs_length

    frame = one_run.copy()
    frame.loc[frame.index[0], ["verdict", "max_abs"]] = ["fail", frame["budget"].iloc[0] * 3]
    write_run(frame, {"run_id": frame["run_id"].iloc[0]}, tmp_path, frame["run_id"].iloc[0])
    page, _ = build_dashboard(load_store(tmp_path), tmp_path / "dashboard.html")
    text = page.read_text()
    assert "One run: a trend needs two or more." in text and "The run's time" in text
    assert "not drawn" in text and "NOT REACHED</th>" not in text and "The night's time" not in text
    figure = error_vs_length(frame)
    series = [t for t in figure.data if not t.name.endswith("over its limit")]
    assert series[0].marker.color == series[1].marker.color == PALETTE[0], "a series and its limits: one colour"
    ringed = next(t for t in figure.data if t.name == "over its limit")
    assert len(ringed.x) == 1 and ringed.marker.symbol == "circle-open"


def test_a_pasted_repro_line_does_not_become_the_headline(tmp_path: Path) -> None:
    """A repro line pasted into the sweep's store made the headline "Red: 1 pass, 1 fail" and hid the sweep."""
    sweep = ["run", "--device", "cpu", "--backend", "torch_chunk", "--lengths", "37", "--dtypes", "bf16"]
    assert main([*sweep, "--out", str(tmp_path), "--no-dashboard"]) == 0
    case = '{"seq_lens": [9], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'
    assert main(["run", "--device", "cpu", "--backend", "torch_chunk", "--case", case, "--out", str(tmp_path)]) == 0
    text = (tmp_path / "dashboard.html").read_text()
    status = re.search(r"<p id='status' class='(\w+)'>(.*?)</p>", text)
    assert status and "6 pass" in status.group(2), status
    assert "Newest run kept apart from the sweeps (cases)" in text and "2 pass" in text


def test_a_minimize_run_stays_apart_and_the_cli_counts_runs_as_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After ``minimize --from-run`` the headline was the minimize run ("Red: ... 2 pass, 2 fail"),
    ``--fail-on-flags`` exited 1, and the CLI said "12 runs (12 complete)" where the page said 7."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    sweep = ["run", "--device", "cpu", "--backend", "torch_chunk", "--lengths", "37", "--dtypes", "bf16"]
    assert main([*sweep, "--out", str(tmp_path), "--no-dashboard"]) == 0
    assert main([*sweep, "--out", str(tmp_path), "--no-dashboard"]) == 0
    case = '{"seq_lens": [40], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'
    planted = ["run", "--device", "cpu", "--plugin", "kda_planted_bugs", "--backend", "planted_nan_at_one_position"]
    failing = tmp_path / "failing"
    assert main([*planted, "--case", case, "--out", str(failing), "--no-dashboard"]) == 1
    minimize = ["minimize", "--plugin", "kda_planted_bugs", "--device", "cpu", "--out", str(tmp_path)]
    assert main([*minimize, "--from-run", str(next((failing / "runs").glob("*.parquet")))]) == 1
    capsys.readouterr()
    assert main(["dashboard", "--out", str(tmp_path), "--fail-on-flags"]) == 0
    said = capsys.readouterr().out
    text = (tmp_path / "dashboard.html").read_text()
    status = re.search(r"<p id='status' class='(\w+)'>(.*?)</p>", text)
    assert status and status.group(1) == "pass" and "fail" not in status.group(2).split(":", 2)[-1], status
    assert "Newest run kept apart from the sweeps (minimize)" in text
    sentence = "3 runs: 2 complete sweeps judged; apart: 1 minimize"
    assert sentence in said and sentence in text, said


def test_a_backend_whose_code_changed_says_so_in_the_regressions(tmp_path: Path) -> None:
    """A plugin edited between two runs read as "no change of environment, suite or seed (nondeterminism, or a
    flaky kernel)"."""
    plugin = tmp_path / "my_kda_backend.py"
    source = """from kda_kernels.protocol import BackendOutput
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk


class Edited(TorchChunk):
    name = "edited_backend"
    scale = {scale}

    def run(self, inputs):
        out = super().run(inputs)
        return BackendOutput(out.o * self.scale, out.final_state, out.checkpoint_states)


register("edited_backend", Edited)
"""
    store = tmp_path / "store"
    runs = []
    for scale in ("1.0", "1.5"):
        plugin.write_text(source.format(scale=scale))
        argv = ["run", "--device", "cpu", "--plugin", str(plugin), "--backend", "edited_backend"]
        code = subprocess.run(
            [sys.executable, "-c", "import sys; from kda_conformance.cli import main; sys.exit(main(sys.argv[1:]))",
             *argv, "--lengths", "37", "--dtypes", "bf16", "--out", str(store), "--no-dashboard"],
            capture_output=True, text=True,
        )  # fmt: skip
        runs.append(code.returncode)
    assert runs == [0, 1], runs
    loaded = load_store(store)
    hashes = loaded.records.groupby("run_id")["backend_code"].first()
    assert hashes.nunique() == 2 and all(len(h) == 12 for h in hashes), hashes
    regressions = find_regressions(loaded.records, loaded.judged_runs)
    assert not regressions.empty
    assert regressions["cause"].str.startswith("the backend's code changed (").all(), regressions["cause"].tolist()
