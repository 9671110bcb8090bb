"""Replay of autotune's choices (kernels/autotune_replay.py), on a test double of a JIT kernel under Triton's
own ``triton.autotune``: the recorded config is launched with no benchmark, an unknown key tunes and says so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fake_jit import FakeJit

triton = pytest.importorskip("triton")

from kda_kernels import autotune_replay as replay  # noqa: E402

TIMES = {16: 3.0, 32: 1.0, 64: 2.0}  # BLOCK -> the benchmark's time: autotune picks 32


def kernel_body(x, n, BLOCK):
    """The Python function under the JIT (its module and name name the kernel in the file)."""


def autotuned() -> tuple[FakeJit, object, list[int]]:
    jit, benched = FakeJit(kernel_body), []

    def bench(kernel_call, quantiles=None, **kwargs):
        kernel_call()
        benched.append(jit.launched[-1])
        return [TIMES[jit.launched[-1]]] * 3

    configs = [triton.Config({"BLOCK": block}, num_warps=4) for block in TIMES]
    return jit, triton.autotune(configs=configs, key=["n"], do_bench=bench)(jit), benched


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from triton.runtime.autotuner import Autotuner

    # Triton's own autotuning: the CPU interpreter's workaround (which launches the first config) set aside.
    monkeypatch.setattr(Autotuner, "run", getattr(Autotuner.run, "__wrapped__", Autotuner.run))
    monkeypatch.delenv(replay.RECORD_VARIABLE, raising=False)
    monkeypatch.delenv(replay.REPLAY_VARIABLE, raising=False)
    yield
    replay.uninstall()


def test_a_warm_run_records_and_a_cold_one_replays_without_benchmarking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: None, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(replay.RECORD_VARIABLE, str(tmp_path / "parts"))
    replay.install({})
    jit, tuner, benched = autotuned()
    tuner.run(None, 128)
    assert benched == [16, 32, 64] and jit.launched[-1] == 32, "the warm run tunes"
    [part] = (tmp_path / "parts").glob("autotune-*.json")
    device, version, choices = replay.merge([part])
    name = f"{__name__}.kernel_body"
    chosen = replay.config_dict(triton.Config({"BLOCK": 32}, num_warps=4))
    assert choices == {name: {replay.key_id(replay.key_text((128,))): chosen}}
    replay.write(tmp_path / "h200.json", device, version, choices, "test")
    saved = json.loads((tmp_path / "h200.json").read_text())
    assert saved["keys"] == 1 and saved["recorded"] and saved["triton"] == version

    replay.uninstall()
    monkeypatch.delenv(replay.RECORD_VARIABLE)
    replay.install(replay.load(tmp_path / "h200.json"), "h200.json")
    jit, tuner, benched = autotuned()  # a cold machine: a fresh autotuner, nothing in its cache
    tuner.run(None, 128)
    assert benched == [] and jit.launched == [32] and replay.replayed() == 1, "replayed: no benchmark"
    tuner.run(None, 256)  # a key the file does not hold: it tunes, and says so once
    tuner.run(None, 512)
    assert benched == [16, 32, 64] * 2 and jit.launched[-1] == 32
    err = capsys.readouterr().err
    assert err.count("autotune replay") == 1 and "no recorded choice; tuning" in err, err


def test_a_recorded_config_no_longer_in_the_kernels_list_tunes(clean: None) -> None:
    _, probe, _ = autotuned()
    name = replay.kernel_name(probe)
    gone = {"kwargs": {"BLOCK": 128}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    replay.install({name: {replay.key_id(replay.key_text((128,))): gone}})
    _, tuner, benched = autotuned()
    tuner.run(None, 128)
    assert benched == [16, 32, 64] and replay.replayed() == 0


def test_parts_of_two_gpu_models_are_not_merged(tmp_path: Path) -> None:
    for n, device in enumerate(("NVIDIA H200", "NVIDIA H100")):
        (tmp_path / f"autotune-{n}.json").write_text(json.dumps({"device": device, "triton": "3.6.0", "choices": {}}))
    with pytest.raises(ValueError, match="one of each"):
        replay.merge(sorted(tmp_path.glob("*.json")))


def test_replay_is_off_on_a_cpu_and_by_its_switch(monkeypatch: pytest.MonkeyPatch, clean: None) -> None:
    assert replay.activate(torch.device("cpu")) == "" and not replay._state["installed"]
    monkeypatch.setenv(replay.REPLAY_VARIABLE, "0")
    assert replay.activate(torch.device("cuda")) == "off" and not replay._state["installed"]
    assert replay.file_for("NVIDIA H200").name == "nvidia-h200.json"


def test_the_autotune_command_writes_the_gpu_models_file_and_names_a_bad_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kda_conformance.cli import main

    parts = tmp_path / "parts"
    parts.mkdir()
    choice = {"kwargs": {"BLOCK": 32}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    for pid, key in ((1, "[128]"), (2, "[256]")):  # two processes, one key each
        part = {"device": "NVIDIA H200", "triton": "3.6.0", "choices": {"m.kernel": {key: choice}}}
        (parts / f"autotune-{pid}.json").write_text(json.dumps(part))
    note = "KDA_AUTOTUNE_RECORD=DIR kda-conformance nightly on a fresh H200"
    assert main(["autotune", "--from", str(parts), "--out", str(tmp_path / "h200.json"), "--note", note]) == 0
    saved = json.loads((tmp_path / "h200.json").read_text())
    assert saved["device"] == "NVIDIA H200" and saved["keys"] == 2 and saved["command"] == note
    assert saved["choices"]["m.kernel"] == [[choice, sorted(replay.key_id(k) for k in ("[128]", "[256]"))]], (
        "one line per config chosen, with its keys' ids"
    )
    assert main(["autotune", "--from", str(tmp_path / "nothing")]) == 2
    assert "no autotune-*.json parts" in capsys.readouterr().out


def test_a_new_recording_keeps_the_files_other_keys_unless_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kda_conformance.cli import main

    old = {"kwargs": {"BLOCK": 16}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    new = {**old, "kwargs": {"BLOCK": 64}}
    out = tmp_path / "h100.json"
    replay.write(out, "NVIDIA H100", "3.6.0", {"m.kernel": {replay.key_id("[1]"): old, replay.key_id("[2]"): old}})
    parts = tmp_path / "parts"
    parts.mkdir()
    part = {"device": "NVIDIA H100", "triton": "3.6.0", "choices": {"m.kernel": {"[2]": new}, "m.other": {"[3]": new}}}
    (parts / "autotune-7.json").write_text(json.dumps(part))

    assert main(["autotune", "--from", str(parts), "--out", str(out)]) == 0
    assert "1 more kept from the file" in capsys.readouterr().out
    saved = replay.load(out)
    assert saved["m.kernel"] == {replay.key_id("[1]"): old, replay.key_id("[2]"): new}, "the file's other key kept"
    assert saved["m.other"] == {replay.key_id("[3]"): new}
    assert json.loads(out.read_text())["keys"] == 3

    assert main(["autotune", "--from", str(parts), "--out", str(out), "--replace"]) == 0
    assert replay.load(out)["m.kernel"] == {replay.key_id("[2]"): new}, "--replace writes the parts alone"

    replay.write(out, "NVIDIA H200", "3.6.0", {"m.kernel": {replay.key_id("[1]"): old}})
    assert main(["autotune", "--from", str(parts), "--out", str(out)]) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert "holds NVIDIA H200" in said and "--replace" in said, said
    assert replay.load(out) == {"m.kernel": {replay.key_id("[1]"): old}}, "another model's file left as it was"


def test_the_committed_h200_file_is_one_gpu_models_choices_and_ships_with_the_package() -> None:
    path = replay.file_for("NVIDIA H200")
    data = json.loads(path.read_text())
    assert (data["device"], data["kernels"]) == ("NVIDIA H200", len(data["choices"]))
    assert data["keys"] == sum(len(keys) for keys in replay.load(path).values())
    for kernel, keys in replay.load(path).items():
        assert "." in kernel and keys, kernel
        for key, config in keys.items():
            assert replay.key_id(key) == key and set(config) >= {"kwargs", "num_warps", "num_stages"}
    assert path.stat().st_size < 40 * sum(len(keys) for keys in replay.load(path).values()) + 20_000, (
        "each key a 12-digit id under the config chosen for it, not its text"
    )
    pyproject = Path(__file__).parents[1].joinpath("pyproject.toml").read_text()
    assert 'kda_kernels = ["autotune/*.json"]' in pyproject


def test_a_file_of_key_texts_as_written_before_still_replays(tmp_path: Path, clean: None) -> None:
    """Files and parts before 2026-12-03 held each key's text: they load, merge and replay under its id."""
    _, probe, _ = autotuned()
    name = replay.kernel_name(probe)
    chosen = replay.config_dict(triton.Config({"BLOCK": 64}, num_warps=4))
    old = {"device": "NVIDIA H200", "triton": "3.6.0", "choices": {name: {replay.key_text((128,)): chosen}}}
    (tmp_path / "autotune-old.json").write_text(json.dumps(old))
    _, _, merged = replay.merge([tmp_path / "autotune-old.json"])
    replay.write(tmp_path / "h200.json", "NVIDIA H200", "3.6.0", merged)
    replay.install(replay.load(tmp_path / "h200.json"))
    jit, tuner, benched = autotuned()
    tuner.run(None, 128)
    assert benched == [] and jit.launched == [64], "the old file's choice, by the key's id"
