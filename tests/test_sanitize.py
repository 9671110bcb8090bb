"""The sanitizer lane (``kda-conformance sanitize``): a finding's smallest case rerun under compute-sanitizer, the
tool's report read back (kernel, access, thread, block) and shown on the findings page. On the CPU the tool is a
stand-in (tests/doubles/fake_compute_sanitizer.py) that runs the rerun and writes a report in the tool's format;
the reports below are written in the formats of NVIDIA's Compute Sanitizer documentation (its memcheck_demo, in
the older "at 0x.. in file:line:kernel" form and the newer "at kernel+0x.." form), not recorded on a GPU."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
from suite_paths import ENV, PLUGINS, REPO

from kda_cases.case import Case
from kda_conformance.cli import main
from kda_conformance.cli.exits import NOTHING_RAN
from kda_conformance.repro.sanitize import find_sanitizer, parse_report

MEMCHECK_OLD = """\
========= COMPUTE-SANITIZER
Running unaligned_kernel
========= Invalid __global__ write of size 4 bytes
=========     at 0x160 in memcheck_demo.cu:6:unaligned_kernel()
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f671ac00001 is misaligned
=========     and is inside the nearest allocation at 0x7f671ac00000 of size 4 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame: [0x2774ec]
=========                in /lib/x86_64-linux-gnu/libcuda.so.1
=========
========= Invalid __global__ write of size 4 bytes
=========     at 0x60 in memcheck_demo.cu:10:out_of_bounds_kernel()
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x87654320 is out of bounds
=========
========= ERROR SUMMARY: 2 errors
"""

# A Triton kernel (no file, no line), in the newer form, past the print limit, with the API error it caused.
MEMCHECK_TRITON = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at chunk_kda_fwd_kernel_intra_sub_chunk+0x1a30
=========     by thread (96,0,0) in block (3,1,0)
=========     Address 0x7f3e1c000408 is misaligned
=========
========= Program hit cudaErrorMisalignedAddress (error 716) due to "misaligned address" on CUDA API call to \
cuStreamSynchronize.
=========
========= ERROR SUMMARY: 129 errors
"""

INITCHECK = """\
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at recompute_w_u_fwd_kernel+0x2f0
=========     by thread (0,0,0) in block (12,0,0)
=========     Address 0x7f3e1d000000
=========
========= ERROR SUMMARY: 1 error
"""

RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at 0x1a0 in block_error.cu:17:sumKernel(int*, int*)
=========     and Read access at 0x1c0 in block_error.cu:21:sumKernel(int*, int*) [4 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""

CLEAN = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"


def test_the_report_names_the_kernel_the_access_and_the_thread() -> None:
    old = parse_report(MEMCHECK_OLD)
    assert old.count == 2 and [e.kernel for e in old.errors] == ["unaligned_kernel", "out_of_bounds_kernel"]
    first = old.errors[0]
    assert (first.kind, first.thread, first.block) == ("Invalid __global__ write of size 4 bytes", "0,0,0", "0,0,0")
    assert first.address == "Address 0x7f671ac00001 is misaligned"
    assert "inside the nearest allocation" in first.detail[0] and not any("Host Frame" in d for d in first.detail)
    triton = parse_report(MEMCHECK_TRITON)
    assert triton.errors[0].kernel == "chunk_kda_fwd_kernel_intra_sub_chunk" and triton.count == 129
    assert triton.api_errors[0].startswith("Program hit cudaErrorMisalignedAddress (error 716)")
    assert triton.summary() == (
        "Invalid __global__ read of size 16 bytes in chunk_kda_fwd_kernel_intra_sub_chunk, thread (96,0,0) block "
        "(3,1,0); Address 0x7f3e1c000408 is misaligned (and 128 more)"
    )
    init = parse_report(INITCHECK)
    assert init.errors[0].kind.startswith("Uninitialized __global__ memory read")
    assert init.errors[0].kernel == "recompute_w_u_fwd_kernel"
    race = parse_report(RACECHECK)
    assert race.errors[0].kernel == "sumKernel" and race.errors[0].kind.startswith("Error: Race reported")
    assert parse_report(CLEAN).summary() == "no error" and parse_report("").summary() == "no report"


def test_without_the_tool_nothing_runs_and_it_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    if Path("/usr/local/cuda/bin/compute-sanitizer").exists():
        pytest.skip("this machine has the CUDA toolkit's compute-sanitizer")
    assert find_sanitizer() is None
    store = tmp_path / "store"
    case = Case(seq_lens=(37,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16).to_json()
    assert main(["run", "--device", "cpu", "--backend", "torch_chunk", "--case", case, "--out", str(store)]) == 0
    assert main(["sanitize", "--store", str(store)]) == NOTHING_RAN
    assert "compute-sanitizer is not on PATH, in CUDA_HOME/bin or /usr/local/cuda/bin" in capsys.readouterr().out


def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: str) -> Path:
    """The stand-in tool as an executable file, writing ``report``; the test plugins findable by its reruns."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!{sys.executable}\n" + (REPO / "tests/doubles/fake_compute_sanitizer.py").read_text())
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    written = tmp_path / "report.txt"
    written.write_text(report)
    monkeypatch.setenv("FAKE_SANITIZER_REPORT", str(written))
    return fake


def test_a_findings_rerun_under_the_tool_is_recorded_and_shown_on_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = stand_in(tmp_path, monkeypatch, MEMCHECK_TRITON)
    store = tmp_path / "store"
    plugins = ["--plugin", "kda_planted_bugs"]
    packed = Case(seq_lens=(20, 0, 17), packed=True, initial_state="random", num_heads=1, num_v_heads=1,
                  head_k_dim=16, head_v_dim=16)  # fmt: skip
    argv = ["run", "--device", "cpu", *plugins, "--backend", "planted_zero_length_shifts_sequences"]
    assert main([*argv, "--case", packed.to_json(), "--out", str(store), "--no-dashboard", "--redraws", "0"]) == 1
    small = Case(seq_lens=(37,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    assert main(["run", "--device", "cpu", "--backend", "torch_chunk", "--case", small.to_json(), "--out", str(store),
                 "--no-dashboard"]) == 0  # fmt: skip
    # The finding, then the sample: the smallest case each backend passed whole (the planted bug's failed).
    argv = ["sanitize", "--store", str(store), *plugins, "--sanitizer", str(fake), "--tool", "memcheck"]
    assert main([*argv, "--sample", "1"]) == 0
    written = json.loads((store / "sanitize" / "sanitize.json").read_text())
    assert [w["finding"] for w in written][1:] == [f"sample-torch_chunk-{small.id}"]
    assert [w["backend"] for w in written] == ["planted_zero_length_shifts_sequences", "torch_chunk"]
    [run] = written[0]["runs"]
    assert run["command"].startswith(f"{fake} --tool memcheck --target-processes all") and run["exit"] == 1
    assert run["reports"][0]["errors"][0]["kernel"] == "chunk_kda_fwd_kernel_intra_sub_chunk"
    assert (
        "memcheck: Invalid __global__ read of size 16 bytes in chunk_kda_fwd_kernel_intra_sub_chunk"
        in (written[0]["summary"])
    )
    page = tmp_path / "findings.md"
    argv = ["findings", "--store", str(store), *plugins, "--sanitize", str(store / "sanitize" / "sanitize.json")]
    assert main([*argv, "--page", str(page)]) == 0
    text = page.read_text()
    assert "Sanitizer: memcheck: Invalid __global__ read of size 16 bytes in chunk_kda_fwd_kernel_intra_sub_chunk" in (
        text
    )


def test_the_reruns_replay_the_autotune_choices_the_failing_run_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen on an H100: GLM-5.3-Flash's AMD copy faulted where autotune had chosen num_stages 4 and 5, and not under
    memcheck, where the rerun tuned afresh and chose 2 and 3. ``--autotune-replay DIR`` merges the failing run's
    recorded parts into one file and hands it to every rerun; a folder with none is refused by name."""
    fake = stand_in(tmp_path, monkeypatch, CLEAN)
    noted = tmp_path / "replayed"
    monkeypatch.setenv("FAKE_SANITIZER_NOTE_REPLAY", str(noted))
    store = tmp_path / "store"
    small = Case(seq_lens=(37,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    assert main(["run", "--device", "cpu", "--backend", "torch_chunk", "--case", small.to_json(), "--out", str(store),
                 "--no-dashboard"]) == 0  # fmt: skip
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    stages = {"kwargs": {"BK": 32}, "num_warps": 2, "num_stages": 4, "num_ctas": 1, "maxnreg": None}
    part = {"device": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "choices": {"kernels.kkt_inter": {"[16]": stages}}}
    (recorded / "autotune-527.json").write_text(json.dumps(part))
    argv = ["sanitize", "--store", str(store), "--sanitizer", str(fake), "--tool", "memcheck", "--sample", "1"]
    assert main([*argv, "--autotune-replay", str(recorded)]) == 0
    replay_file = store / "sanitize" / "autotune-replay.json"
    assert noted.read_text() == str(replay_file.resolve())
    written = json.loads(replay_file.read_text())
    assert (written["device"], written["triton"]) == ("NVIDIA H100 80GB HBM3", "3.6.0")
    assert [config for config, _ in written["choices"]["kernels.kkt_inter"]] == [stages]
    assert "every rerun replays the autotune choices of" in (store / "sanitize" / "sanitize.md").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*argv, "--autotune-replay", str(empty)]) == 2
