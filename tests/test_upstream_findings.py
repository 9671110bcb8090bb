"""Findings ready for upstream (``kda-conformance findings``): each ledger entry's status from the newest run
that matched it, new kernel failures grouped by cause (kernel family, kind, case), and standalone tests that
fail on the kernel, pass on a correct backend and skip without their library."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from suite_paths import ENV, PLUGINS

from kda_cases.case import Case
from kda_conformance.cli import main
from kda_conformance.judging.known import KnownIssue, apply_known, load_ledger
from kda_conformance.repro.upstream import findings_markdown, upstream_findings
from kda_conformance.running.blame import CONTRACT
from kda_reports.findings import Budget, Errors, Finding, Limit


def _record(run: str, backend: str, verdict: str, known: str = "", **more: object) -> dict:
    case = Case(seq_lens=(int(more.pop("tokens", 40)),))
    row = {"run_id": run, "backend": backend, "check": "budget", "verdict": verdict, "known_issue": known}
    row |= {"case_id": case.id, "case_json": case.to_json(), "case_total_tokens": case.total_tokens}
    row |= {"ratio": 0.5, "rel_rms_ratio": 0.4, "reason": "", "first_bad": "", "repro": f"repro {case.id}"}
    library = {"fla": "fla-core 0.6.0", "aiter": "AITER 1a2b3c (KDA_AITER_SRC)"}.get(backend.split("_")[0], "")
    row |= {"library": library}
    return row | more


_ENDED = "the process ended during {}'s call in check {} (os._exit, a signal, an abort or a kill)"


def _issue(id_: str, backends: tuple[str, ...]) -> KnownIssue:
    return KnownIssue(id=id_, backends=backends, description=f"{id_} text", upstream="", added="", worst=10.0)


def test_each_ledger_entry_gets_its_status_from_each_cases_newest_run() -> None:
    records = pd.DataFrame(
        [
            _record("r1", "fla_chunk", "known", "still-bad", ratio=7.0),
            _record("r2", "fla_chunk", "known", "still-bad", ratio=9.0, first_bad="seq 0 token 3 head 0", tokens=20),
            _record("r2", "fla_chunk", "known", "still-bad", ratio=8.0, tokens=90),
            _record("r1", "aiter_default", "known", "fixed-now", ratio=float("inf")),
            _record("r2", "aiter_default", "pass", "fixed-now"),
            # new: one crash met by two checks is one finding; the suite's own failure is nobody's kernel's
            _record("r2", "fla_chunk32", "error", reason="RuntimeError: CUDA error: misaligned address (at x.py:3)"),
            _record("r2", "fla_chunk32", "error", check="prefix", reason="CUDA error: misaligned address"),
            _record("r2", "(suite)", "error", reason="the float64 truth is not finite"),
            # the cases a quarantine kept from launching after that crash are the crash's, not a finding
            _record("r2", "fla_chunk32", "error", tokens=1, observed="not launched", reason="quarantined after x"),
            # one abort met by two checks is one finding, whatever the backend and check its message names
            *(
                _record(
                    "r2", "fla_chunk", "error", tokens=tokens, check=check, reason=_ENDED.format("fla_chunk", check)
                )
                for tokens, check in ((2, "packing"), (400, "prefix"))
            ),
            _record("r1", "fla_recurrent", "fail", ratio=3.0),  # its newest run passes
            _record("r2", "fla_recurrent", "pass"),
        ]
    )
    ledger = (_issue("still-bad", ("fla_chunk",)), _issue("fixed-now", ("aiter_default",)), _issue("gone", ("x",)))
    found = {f.id: f for f in upstream_findings(records, ledger)}
    # One crash is one finding over every case and check it met, for every copy of the kernel (fla_chunk and
    # fla_chunk32 are one family).
    ended = "new-fla-chunk-triton-the-process-ended-during-the-backend-s-call"
    misaligned = "new-fla-chunk-triton-cuda-error-misaligned-address"
    assert set(found) == {"still-bad", "fixed-now", "gone", misaligned, ended}
    assert found[ended].check == "packing, prefix" and found[ended].case_id == Case(seq_lens=(2,)).id
    bad = found["still-bad"]
    # Its cases as each one's newest run has them: r2's two, and r1's 40-token case, which r2 did not run.
    assert (bad.status, bad.run, bad.cases, bad.worst, bad.kernel) == (
        "open",
        "r2",
        3,
        "9x the limit",
        "fla-core 0.6.0",
    )
    assert bad.first_bad == "seq 0 token 3 head 0" and bad.repro == f"repro {Case(seq_lens=(20,)).id}"
    assert found["fixed-now"].status == "fixed" and found["fixed-now"].worst == "passes"
    assert found["gone"].status == "not seen"
    crash = found[misaligned]
    assert crash.status == "new" and crash.check == "budget, prefix" and "misaligned address" in crash.worst
    assert crash.case_id == Case(seq_lens=(40,)).id  # the crash's own case, not a quarantined one
    assert crash.tier == "broken" and crash.family == "FLA chunk (Triton)"
    assert found[ended].case_ids == (Case(seq_lens=(2,)).id, Case(seq_lens=(400,)).id)


def test_a_ledger_entry_written_after_a_run_claims_the_failures_it_allows() -> None:
    """A run's records hold what its day's ledger matched; the page reads them with today's: a failure the
    entry allows is the entry's, one past its allowed worst, of another dtype or another run's environment
    stays new."""
    fp16 = Case(seq_lens=(300,), dtype="fp16")
    as_fp16 = {"case_json": fp16.to_json(), "case_id": fp16.id, "device": "cuda:0", "env_variables": "{}"}
    under_ieee = as_fp16 | {"env_variables": '{"TRITON_F32_DEFAULT": "ieee"}'}
    records = pd.DataFrame(
        [
            _record("r1", "sglang_chunk", "fail", rel_rms_ratio=1.6, **as_fp16),
            _record("r1", "sglang_chunk", "fail", rel_rms_ratio=1.3, check="steps", **as_fp16),
            _record("r1", "sglang_chunk", "fail", rel_rms_ratio=1.4, device="cuda:0", env_variables="{}"),  # bf16
            _record("r1", "sglang_chunk", "fail", rel_rms_ratio=9.0, check="poison", **as_fp16),  # past allowed
            _record("r1", "sglang_chunk", "fail", rel_rms_ratio=1.2, check="prefix", **under_ieee),
        ]
    )
    entry = dataclasses.replace(
        _issue("fp16-rel-rms", ("sglang_chunk",)), worst=1.66, device="cuda", when={"dtype": ("fp16",)},
        environment={"TRITON_F32_DEFAULT": ("",)},
    )  # fmt: skip
    found = {f.id: f for f in upstream_findings(records, (entry,))}
    assert found["fp16-rel-rms"].status == "open" and found["fp16-rel-rms"].cases == 1, found["fp16-rel-rms"]
    assert found["fp16-rel-rms"].check == "budget, steps"
    # Past the limits, one finding per case: the bf16 case's, and the fp16 case's poison and prefix together.
    new = sorted(i for i in found if i.startswith("new-"))
    bf16 = Case(seq_lens=(40,)).id
    assert new == sorted(
        [f"new-fla-chunk-triton-past-the-limit-{bf16}", f"new-fla-chunk-triton-past-the-limit-{fp16.id}"]
    )
    assert found[f"new-fla-chunk-triton-past-the-limit-{fp16.id}"].check == "poison, prefix"


def test_a_ledger_entry_that_names_an_error_claims_the_errors_of_earlier_runs() -> None:
    """FLA's FlashKDA dispatch raised "all tensors must be contiguous" on strided inputs in a night before its
    entry existed: the page reads those errors as the entry's; another error, or a contiguous case, stays new."""
    strided = Case(seq_lens=(300,), input_layout="fused")
    on_gpu = {"case_json": strided.to_json(), "case_id": strided.id, "device": "cuda:0", "env_variables": "{}"}
    refused = "RuntimeError: all tensors must be contiguous (at __init__.py:40)"
    records = pd.DataFrame(
        [
            _record("r1", "fla_chunk_dispatch", "error", reason=refused, **on_gpu),
            _record("r1", "fla_chunk_dispatch", "error", reason="the process ended during its call", **on_gpu),
            _record("r1", "fla_chunk_dispatch", "error", reason=refused, device="cuda:0", env_variables="{}"),
        ]
    )
    entry = dataclasses.replace(
        _issue("dispatch-strided", ("fla_chunk_dispatch",)), device="cuda",
        when={"input_layout": ("fused", "head_major")}, raises=("all tensors must be contiguous",),
    )  # fmt: skip
    found = {f.id: f for f in upstream_findings(records, (entry,))}
    assert found["dispatch-strided"].status == "open" and found["dispatch-strided"].cases == 1
    assert sorted(i for i in found if i.startswith("new-")) == [
        "new-flashkda-cuda-runtimeerror-all-tensors-must-be-contiguous-at",
        "new-flashkda-cuda-the-process-ended-during-its-call",
    ]


def test_a_ledger_entry_that_names_a_crash_claims_it_on_the_page_and_leaves_it_an_error_in_its_run() -> None:
    """FLA's chunk-32 misaligned address and FlashKDA's abort on one-token batches were `new` every night: a
    crash kills the device or the process, so no entry could make it known. An entry's `crashes` lists it under
    the entry on the page, while the run still records it as an error (its device lost, its run exit 3)."""
    one_token = Case(seq_lens=(1,) * 64, packed=True)
    gpu = {"device": "cuda:0", "env_variables": "{}"}
    aborted = "the process ended during flashkda_cuda's call in check packing (os._exit, a signal, an abort or a kill)"
    records = pd.DataFrame(
        [
            _record("r1", "fla_chunk32", "error", reason="AcceleratorError: CUDA error: misaligned address", **gpu),
            _record("r1", "fla_chunk32", "error", reason="CUDA error: an illegal memory access was encountered", **gpu),
            _record(
                "r1",
                "flashkda_cuda",
                "error",
                reason=aborted,
                case_json=one_token.to_json(),
                case_id=one_token.id,
                **gpu,
            ),
            _record("r1", "flashkda_cuda", "error", reason=aborted, tokens=2, **gpu),  # not a one-token batch
        ]
    )
    misaligned = dataclasses.replace(_issue("chunk32-misaligned", ("fla_chunk32",)), crashes=("misaligned address",))
    abort = dataclasses.replace(
        _issue("one-token-abort", ("flashkda_cuda",)), when={"max_len": (1,)}, crashes=("the process ended during",)
    )
    found = {f.id: f for f in upstream_findings(records, (misaligned, abort))}
    assert found["chunk32-misaligned"].status == "open" and "misaligned address" in found["chunk32-misaligned"].worst
    assert found["one-token-abort"].status == "open" and found["one-token-abort"].case_id == one_token.id
    assert sorted(i for i in found if i.startswith("new-")) == [
        "new-fla-chunk-triton-cuda-error-an-illegal-memory-access-was-enc",
        "new-flashkda-cuda-the-process-ended-during-the-backend-s-call-os",
    ]
    crashed = Finding("budget", Case(seq_lens=(40,)), "fla_chunk32", "cuda", "error", reason="misaligned address")
    [still] = apply_known([crashed], (misaligned,))
    assert still.verdict == "error" and not still.known_issue


def test_a_causal_leak_on_the_cases_of_a_broken_kernels_entry_is_known_and_no_other() -> None:
    """On an H100 (2026-12-06) vLLM's and SGLang's copies failed the prefix check on T63+10 fp32 with q and k
    views of a fused projection and no in-kernel l2norm: the strided-read entry's cases. A prefix leak has no
    error over a limit, so no entry could claim it and each copy's leak read as a new finding."""
    [strided] = [i for i in load_ledger() if i.id == "servers-strided-qk-without-l2norm"]
    fused = Case(seq_lens=(63, 10), packed=True, dtype="fp32", input_layout="fused", l2norm_in_kernel=False)
    text = "outputs before token 39 changed by max-abs 5.846e+03 (4.35e+04 of the limit) from token 1"

    def leak(case: Case, verdict: str = "fail") -> Finding:
        return Finding("prefix", case, "vllm_chunk", "cuda", verdict, tensor="o", reason=text, observed="causal leak")

    [known] = apply_known([leak(fused)], (strided,))
    assert known.verdict == "known" and known.known_issue == strided.id, known
    [other] = apply_known([leak(fused.replace(l2norm_in_kernel=True))], (strided,))
    assert other.verdict == "fail" and not other.known_issue
    bounded = dataclasses.replace(strided, worst=10.0)  # an entry that bounds its errors cannot bound a leak
    [still] = apply_known([leak(fused)], (bounded,))
    assert still.verdict == "fail" and not still.known_issue
    [passed] = apply_known([leak(fused, "pass")], (dataclasses.replace(strided, always_fails=True),))
    assert passed.verdict == "pass" and not passed.known_issue


def test_a_replay_that_differs_from_its_eager_call_is_the_cause_of_the_error_beside_it() -> None:
    """On an H100 (night-1217) AITER's FlashKDA path failed the graph-replay check on one case with two kinds of
    rows: the replay's errors against the truth (241x, the ledger's entry) and "the replay differs from the
    eager call" (no ratio). The second made a new finding of its own; with today's ledger it is the entry's, on
    that call only: alone in another case it stays new."""
    entry = dataclasses.replace(_issue("stale-boundaries", ("aiter_flashkda",)), worst=241.0, checks=("graph_replay",))
    replay = {"check": "graph_replay", "ratio": float("nan"), "rel_rms_ratio": float("nan")}
    records = pd.DataFrame(
        [
            _record("r1", "aiter_flashkda", "fail", **replay, reason="the replay differs from the eager call"),
            _record("r1", "aiter_flashkda", "fail", check="graph_replay", ratio=88.6, rel_rms_ratio=241.0),
            _record("r1", "aiter_flashkda", "fail", **replay, tokens=64, reason="the replay differs"),
        ]
    )
    found = {f.id: f for f in upstream_findings(records, (entry,))}
    assert found["stale-boundaries"].status == "open" and found["stale-boundaries"].cases == 1
    assert sorted(found) == ["new-aiter-flashkda-triton-past-the-limit-" + Case(seq_lens=(64,)).id, "stale-boundaries"]


def test_a_launch_failures_entry_claims_its_crash_and_no_wrong_numbers_on_its_check() -> None:
    """On an H100 (2026-12-06) vLLM's copy gave wrong outputs (rel-RMS 0.92) behind 1,048,176 tokens of filler,
    its chunk states past 2^31 elements, and the entry of a launch that fails past 65,535 chunks (worst inf, so
    it bounded nothing) claimed them though that batch had 16,388 chunks and launched. An entry of crashes alone
    (worst 0) claims its crash by message and no failure with numbers; the int32 entry claims those."""
    issues = {i.id: i for i in load_ledger()}
    launch, states = issues["servers-chunk-launch-past-65535-chunks"], issues["servers-chunk-states-offset-int32"]
    case = Case(seq_lens=(300,), dtype="bf16", num_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128)
    limit = Limit("max_abs", 1.507e-3, 3.768e-4, 2.448e-4, 3.907e-3, "baseline")
    budget = Budget("o", limit, dataclasses.replace(limit, metric="rel_rms", value=7.542e-3))
    errors = Errors(6.253e-2, 9.172e-1, 1.0, 0, True)
    wrong = Finding("offsets_past_2_31", case, "vllm_chunk", "cuda:0", "fail", "o", errors=errors, budget=budget)
    [alone] = apply_known([wrong], (launch,))
    assert alone.verdict == "fail" and not alone.known_issue and not alone.problems, alone
    [known] = apply_known([wrong], (launch, states))
    assert known.verdict == "known" and known.known_issue == states.id, known
    assert launch.names_crash("Triton Error [CUDA]: invalid argument") and not launch.allowed
    assert states.names_crash("CUDA error: an illegal memory access was encountered")


def test_new_findings_whose_kinds_share_a_truncated_id_keep_ids_of_their_own() -> None:
    long = "a failure whose first line is longer than an id keeps of it, ending in "
    records = pd.DataFrame([_record("r1", "fla_chunk", "error", reason=long + end) for end in ("one", "two")])
    ids = [f.id for f in upstream_findings(records, ())]
    assert len(ids) == 2 and len(set(ids)) == 2 and ids[1] == ids[0] + "-2", ids


def test_a_finding_whose_backend_gives_no_standalone_call_gets_no_file_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file runs with torch, the kernel's package and pytest alone, or it is not written: a planted bug of the
    suite's own has no package of its own (tests/test_standalone_findings.py writes and runs one that has)."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    case = Case(seq_lens=(40,), num_heads=1, num_v_heads=1, head_k_dim=32, head_v_dim=32)
    run = ["run", "--plugin", "kda_planted_bugs", "--backend", "planted_nan_at_one_position", "--device", "cpu"]
    assert main([*run, "--case", case.to_json(), "--out", str(tmp_path / "store"), "--no-dashboard"]) == 1
    page, tests = tmp_path / "findings.md", tmp_path / "findings"
    argv = ["findings", "--store", str(tmp_path / "store"), "--page", str(page), "--plugin", "kda_planted_bugs"]
    assert main([*argv, "--write-tests", str(tests), "--device", "cpu"]) == 0
    text = page.read_text()
    finding_id = f"new-planted-nan-at-one-position-not-finite-{case.id}"
    said = "not written: planted_nan_at_one_position give no standalone call; it reruns with its repro line"
    assert f"| [{finding_id}](#{finding_id}) | new | broken |" in text and said in text, text
    assert not list(tests.glob("test_*.py"))


def test_the_findings_page_goes_under_the_output_folder_unless_given_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never into the tracked docs/findings.md by default."""
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    assert main(["run", "--backend", "torch_chunk", "--device", "cpu", "--lengths", "37", "--dtypes", "bf16",
                 "--out", str(store), "--no-dashboard"]) == 0  # fmt: skip
    assert main(["findings", "--store", str(store)]) == 0
    assert "# Findings ready for upstream" in (store / "findings.md").read_text()
    assert main(["findings", "--store", str(store), "--out", str(tmp_path / "pages")]) == 0
    assert (tmp_path / "pages" / "findings.md").exists()
    assert (
        main(["findings", "--store", str(store), "--page", str(tmp_path / "one.md"), "--issue", str(tmp_path / "i.md")])
        == 0
    )
    assert (tmp_path / "one.md").exists() and not (tmp_path / "docs").exists()
    assert (tmp_path / "i.md").read_text() == "", "no new finding: an empty issue body, which CI does not post"
    # A night whose shards ran on two machines names both (the page of seed 1206 named the H100 only).
    [part] = (store / "runs").glob("*.parquet")
    run_id = pd.read_parquet(part)["run_id"].iloc[0]
    other = pd.read_parquet(part).assign(env_device_name="Another CPU")
    other.to_parquet(part.with_name(f"{run_id}.s2of2.parquet"))
    assert main(["findings", "--store", str(store), "--page", str(tmp_path / "two.md")]) == 0
    header = (tmp_path / "two.md").read_text().splitlines()[2]
    assert f"from runs {run_id} (" in header and "cpu Another CPU" in header and header.count("cpu ") == 2, header


def test_a_cpu_store_does_not_list_the_gpu_ledger_entries_as_not_seen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`findings --store` of a CPU store listed 18 GPU ledger entries as "not seen"; they are counted instead."""
    store = tmp_path / "store"
    assert main(["run", "--backend", "torch_chunk", "--device", "cpu", "--lengths", "37", "--dtypes", "bf16",
                 "--out", str(store), "--no-dashboard"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["findings", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    cuda = [issue.id for issue in load_ledger() if issue.device == "cuda"]
    assert cuda and not any(f" {entry}:" in out for entry in cuda), out
    said = f"{len(cuda)} ledger entries for cuda, where no run of the store ran, not listed"
    assert said in out and said in (store / "findings.md").read_text()


@pytest.mark.slow
def test_a_findings_rerun_that_loses_the_device_goes_last_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sticky device error in one finding's rerun (FLA's misaligned address on the H200) ends what the
    process may run: it is rerun after the others, which keep their files, and still gets its own."""
    doubles = str(PLUGINS.parent / "doubles")
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.syspath_prepend(doubles)
    path = [str(PLUGINS), doubles, os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
    store = tmp_path / "store"
    case = Case(seq_lens=(20, 0, 17), packed=True, initial_state="random", num_heads=1, num_v_heads=1,
                head_k_dim=16, head_v_dim=16)  # fmt: skip
    for backend in ("fake_kda_sticky", "fake_kda_chunk"):
        argv = ["run", "--plugin", "kda_fake_library", "--backend", backend, "--device", "cpu", "--case"]
        assert main([*argv, case.to_json(), "--out", str(store), "--no-dashboard"]) in (1, 3)
    argv = ["findings", "--store", str(store), "--plugin", "kda_fake_library"]
    assert main([*argv, "--write-tests", str(tmp_path / "tests"), "--device", "cpu"]) == 0
    page = (store / "findings.md").read_text()
    rows = {line.split(" | ")[0]: line for line in page.splitlines() if line.startswith("| [new-")}
    [sticky] = [row for row in rows.values() if "fake_kda_sticky" in row]
    [wrong] = [row for row in rows.values() if "fake_kda_chunk" in row and "past-the-limit" in row]
    # The crash gets its file (written and run in a process of its own), then the suite's rerun loses the device;
    # the other finding was written and run before it.
    assert "the suite's rerun lost the device here" in sticky, sticky
    assert "fails today on cpu" in wrong, wrong


FINDINGS = Path(__file__).resolve().parent.parent / "findings"


COMMITTED = sorted(FINDINGS.glob("test_*.py"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the findings' files run (and fail: findings/README.md)")
@pytest.mark.parametrize("file", COMMITTED, ids=lambda f: f.name)
def test_each_committed_findings_file_skips_on_a_cpu_saying_why(file: Path, tmp_path: Path) -> None:
    """Written where the finding was measured (a GPU) by `findings --write-tests`: here a skip naming the GPU,
    and findings/README.md says what it is. Run as a maintainer runs it, copied alone into an empty folder
    (under the repository, pytest would load the suite's conftest.py beside it)."""
    shutil.copy(file, tmp_path)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly",
                           file.name], capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout[-2000:]
    assert "needs a GPU (the finding was measured on" in done.stdout or "needs " in done.stdout, done.stdout
    assert file.name in (FINDINGS / "README.md").read_text(), f"findings/README.md does not say what {file.name} is"


def test_a_page_written_without_tests_names_the_committed_file_of_an_open_finding(tmp_path: Path) -> None:
    from kda_conformance.cli.findings import with_committed_test

    (tmp_path / "test_servers_fp32_tf32_sglang.py").write_text("")
    (tmp_path / "test_servers_fp32_tf32_vllm.py").write_text("")
    (tmp_path / "test_servers_fp32_tf32_other_sglang.py").write_text("")  # another id's, of no library here
    records = pd.DataFrame([_record("r1", "sglang_chunk", "known", "servers-fp32-tf32", ratio=9.0)])
    ledger = (_issue("servers-fp32-tf32", ("sglang_chunk",)), _issue("not-seen-here", ("sglang_chunk",)))
    found = {f.id: with_committed_test(f, tmp_path) for f in upstream_findings(records, ledger)}
    assert found["servers-fp32-tf32"].test == (
        "findings/test_servers_fp32_tf32_sglang.py, findings/test_servers_fp32_tf32_vllm.py (in the repository)"
    )
    assert found["not-seen-here"].test == "", "no file, and not open: nothing to name"


def test_the_newest_run_is_the_one_that_started_last_whatever_its_name() -> None:
    """A night's id is the user's: ``servers-n20b`` ran before ``night-e``, though its name sorts after."""
    records = pd.DataFrame(
        [
            _record("servers-n20b", "sglang_chunk", "fail", ratio=3.0, env_date="2026-12-03T08:30:00Z"),
            _record("night-e", "sglang_chunk", "fail", ratio=5.0, env_date="2026-12-03T13:05:00Z"),
        ]
    )
    [new] = upstream_findings(records, ())
    assert new.run == "night-e" and new.worst.startswith("5"), new


def test_a_later_run_of_other_cases_does_not_drop_a_failure() -> None:
    """Five reruns of single cases on the H100, one process each, into one store: FLA's write into its input
    beta (the first) vanished from the page, because findings came from each backend's newest run only."""
    records = pd.DataFrame(
        [
            _record("a", "fla_chunk", "fail", tokens=64, env_date="2026-12-05T10:44:27Z", subject=CONTRACT,
                    reason="fla_chunk wrote into its input beta", ratio=float("nan")),
            _record("b", "fla_chunk", "pass", tokens=2049, env_date="2026-12-05T10:45:00Z"),
            _record("c", "fla_chunk", "pass", tokens=64, env_date="2026-12-05T10:40:00Z"),
        ]
    )  # fmt: skip
    [new] = upstream_findings(records, ())
    assert new.run == "a" and "broke-the-call-contract" in new.id, new
    # The same case passing in a newer run is the newest word on it: nothing new.
    fixed = pd.concat(
        [records, pd.DataFrame([_record("d", "fla_chunk", "pass", tokens=64, env_date="2026-12-05T11:00:00Z")])]
    )
    assert upstream_findings(fixed.reset_index(drop=True), ()) == []


def test_one_failure_on_three_copies_of_a_kernel_and_two_checks_is_one_finding() -> None:
    """The fp16 128K case failing alike on FLA's chunk kernels and two servers' copies, in two checks, is one
    shared algorithm's failure: one new finding listing its backends and checks, not six."""
    case = Case(seq_lens=(300,), dtype="fp16")
    where = {"case_json": case.to_json(), "case_id": case.id, "tokens": 300}
    records = pd.DataFrame(
        [
            _record(
                "r1", backend, "fail", check=check, rel_rms_ratio=1.8, tier="beyond working precision only", **where
            )
            for backend in ("fla_chunk", "vllm_chunk", "sglang_chunk")
            for check in ("budget", "split_resume")
        ]
    )
    [finding] = upstream_findings(records, ())
    assert finding.id == f"new-fla-chunk-triton-past-the-limit-{case.id}" and finding.family == "FLA chunk (Triton)"
    assert finding.backends == "fla_chunk, sglang_chunk, vllm_chunk" and finding.check == "budget, split_resume"
    assert finding.cases == 1 and finding.tier == "beyond working precision only"
    page = findings_markdown([finding], "a test")
    assert page.count("| [new-") == 1 and "| beyond working precision only |" in page


def test_a_ledger_entry_is_one_cause_with_its_copies_links_and_the_ids_it_took_over() -> None:
    from kda_conformance.cli.ledger import ledger_markdown

    ledger = {issue.id: issue for issue in load_ledger()}
    zero = ledger["chunk-indices-zero-length-member"]
    assert {copy.library.split()[0] for copy in zero.copies} == {"AITER", "vLLM", "SGLang"}
    assert zero.replaces == ("aiter-zero-length-member", "vllm-zero-length-member", "sglang-zero-length-member")
    [fix] = zero.links
    assert fix.ref == "fla-org/flash-linear-attention#909" and "16405f24" in fix.status
    assert fix.url == "https://github.com/fla-org/flash-linear-attention/pull/909"
    assert all(issue.links for issue in ledger.values())
    # An earlier run's records name the ids the entry took over: they are the entry's, not new.
    records = pd.DataFrame([_record("r1", "sglang_chunk", "known", "sglang-zero-length-member", ratio=float("inf"))])
    found = {f.id: f for f in upstream_findings(records, tuple(ledger.values()))}
    assert found["chunk-indices-zero-length-member"].status == "open"
    assert not [i for i in found if i.startswith("new-")]
    page = findings_markdown([found["chunk-indices-zero-length-member"]], "a test")
    assert "- SGLang 0.5.23: sglang/kernels/ops/attention/fla/index.py prepare_chunk_indices (sglang_chunk)" in page
    assert "(https://github.com/fla-org/flash-linear-attention/pull/909)" in page
    # A link not reported upstream reads as its status alone, which says why, in every text that lists it.
    states = ledger["servers-chunk-states-offset-int32"]
    [unreported] = states.links
    found = {f.id: f for f in upstream_findings(records.iloc[0:0], (states,))}
    assert found[states.id].links == (unreported.status,) and unreported.status.startswith("not reported: ")
    page = ledger_markdown((states,))
    assert f"- {unreported.status}\n" in page and "none not reported" not in page


def test_a_ledger_entry_without_an_upstream_link_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "ledger.toml"
    bad.write_text(
        '[[issue]]\nid = "x"\nbackends = ["a"]\ndescription = "d"\nupstream = "u"\nadded = "today"\nworst = 1.0\n'
        'confirmed = "by a run"\n'
    )
    with pytest.raises(ValueError, match="says nothing of where it is tracked upstream"):
        load_ledger(bad)
    bad.write_text(bad.read_text() + '\n[[issue.links]]\nkind = "tweet"\nref = "x"\nstatus = "y"\n')
    with pytest.raises(ValueError, match="link kind 'tweet' not allowed"):
        load_ledger(bad)


def test_the_known_issues_page_is_the_ledger_every_entry_in_it() -> None:
    from kda_conformance.cli.ledger import ledger_markdown

    page = (Path(__file__).resolve().parent.parent / "docs" / "known-issues.md").read_text()
    assert page == ledger_markdown(load_ledger()), "stale: kda-conformance ledger --page docs/known-issues.md"
    for issue in load_ledger():
        assert f"## {issue.id}\n" in page and all(link.ref in page for link in issue.links)
