"""Envelopes as data (cases/envelope.py): a backend's ``supports`` and ``fit`` come from its record, and the
cases drawn for it are drawn inside it, so a backend as narrow as FlashKDA gets as many examples as any."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from suite_paths import PLUGINS, REPO

from kda_cases.case import Case
from kda_cases.envelope import ANY, Envelope
from kda_cases.profiles import get_profile
from kda_cases.strategies import cases
from kda_conformance.cli import main
from kda_kernels import registry

NARROW = Envelope(
    dtypes=("bf16",), head_dims=(128,), equal_head_dims=True, gva=False, gates=("lower_bound",),
    l2norm_in_kernel=(True,), beta_sigmoid_in_kernel=(True,), checkpoints=False,
)  # fmt: skip


def test_a_refusal_names_the_field_and_fit_moves_a_case_inside() -> None:
    case = Case(seq_lens=(40,), dtype="fp32", num_heads=2, num_v_heads=4, gate="log", lower_bound=None,
                safe_gate=False, checkpoints=((0, 16),), state_layout="v_first")  # fmt: skip
    reason = NARROW.refusal(case)
    for field in ("dtypes bf16", "head_dims 128", "gva", "gates lower_bound", "checkpoints"):
        assert field in reason, (field, reason)
    fitted = NARROW.fit(case)
    assert NARROW.refusal(fitted) is None
    # Every axis the envelope does not name is kept.
    assert (fitted.seq_lens, fitted.state_layout, fitted.seed, fitted.num_heads) == (
        case.seq_lens, case.state_layout, case.seed, case.num_heads,
    )  # fmt: skip
    assert ANY.fit(case) is case and ANY.refusal(case) is None


def test_a_bad_envelope_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"Envelope\.dtypes"):
        Envelope(dtypes=("bf8",))
    with pytest.raises(ValueError, match="softplus"):
        Envelope(safe_gate=(True,))


@pytest.mark.parametrize("profile", ["ci", "nightly"])
def test_cases_are_drawn_inside_the_envelope_without_filtering(profile: str) -> None:
    drawn = []

    @settings(max_examples=40, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(cases(get_profile(profile), NARROW))
    def collect(case: Case) -> None:
        drawn.append(case)

    collect()  # no health check is suppressed but slowness: a filtered draw would fail here
    assert len(drawn) == 40 and all(NARROW.refusal(c) is None for c in drawn)
    assert len({c.id for c in drawn}) > 30 and {c.num_heads for c in drawn} != {1}


def test_the_default_envelope_draws_the_profiles_own_cases() -> None:
    """Drawing inside the envelope that takes everything changes nothing: the ci cases stay the ci cases."""
    wide = registry.get("torch_chunk")
    assert dataclasses.replace(wide.envelope, backward=False) == ANY  # it takes everything and has a backward


def _pytest(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(PLUGINS), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "--rootdir", str(REPO),
         "-c", str(REPO / "pyproject.toml"), *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=900,
    )  # fmt: skip


@pytest.mark.slow
def test_a_backend_as_narrow_as_flashkda_gets_every_test_its_examples(tmp_path: Path) -> None:
    """Every property and serving test of the ci profile on a correct plugin backend with FlashKDA's
    envelope: each passes with at least 5 examples (before envelopes were drawn inside, each failed with
    Hypothesis's health check after 0 examples); the checks that cannot apply to it skip saying why."""
    done = _pytest(
        str(REPO / "conformance" / "test_properties.py"), str(REPO / "conformance" / "test_serving.py"),
        "--kda-device", "cpu", "--kda-profile", "ci", "--kda-examples", "5", "--kda-plugin", "kda_narrow",
        "--kda-backend", "narrow_correct", "--kda-out", str(tmp_path), "-q",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    [checks] = (tmp_path / "runs").glob("*.checks.json")
    entries = json.loads(checks.read_text())
    ran = {e["check"]: e["examples"] for e in entries.values()}
    assert len(ran) >= 8 and min(ran.values()) >= 5, ran
    skipped = done.stdout.split("skipped")[-1]
    assert "returns no checkpoint states" in done.stdout or "checkpoint" not in ran, skipped


@pytest.mark.slow
def test_a_planted_bug_behind_a_narrow_envelope_is_caught(tmp_path: Path) -> None:
    done = _pytest(
        str(REPO / "conformance" / "test_properties.py") + "::test_within_budget",
        "--kda-device", "cpu", "--kda-profile", "ci", "--kda-examples", "5", "--kda-plugin", "kda_narrow",
        "--kda-backend", "narrow_one_percent_off", "--kda-out", str(tmp_path), "-q",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:]
    assert "narrow_one_percent_off" in done.stdout and "> limit" in done.stdout


def test_the_first_sweep_runs_a_narrow_backend_with_no_other_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    code = main(["run", "--plugin", "kda_narrow", "--backend", "narrow_correct", "--out", str(tmp_path),
                 "--no-dashboard"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    import pandas as pd

    [parquet] = (tmp_path / "runs").glob("*.parquet")
    frame = pd.read_parquet(parquet)
    assert (frame["verdict"] == "pass").all() and frame["case_id"].nunique() >= 9
    assert set(frame["case_head_k_dim"]) == {128} and set(frame["case_dtype"]) == {"bf16"}


def test_checks_run_moves_the_case_into_the_envelope_for_every_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`checks --run` fits the case for each check, the budget check included: a case with checkpoints runs
    the budget check of a backend whose envelope takes none (on the H200 it was skipped for FlashKDA and the
    servers' copies: "returns no intermediate states")."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    case = '{"seq_lens": [40, 0, 23], "packed": true, "checkpoints": [[0, 16]], "initial_state": "random"}'
    table = tmp_path / "table.md"
    code = main(["checks", "--run", "--device", "cpu", "--plugin", "kda_narrow", "--backend", "narrow_correct",
                 "--case", case, "--out", str(tmp_path), "--table", str(table)])  # fmt: skip
    assert code == 0
    rows = [line.split("|") for line in table.read_text().splitlines() if line.startswith("| narrow_correct")]
    budget = {cells[4].strip() for cells in rows if cells[2].strip() == "budget"}
    assert budget == {"pass"}, rows
    [syncs] = [cells for cells in rows if cells[2].strip() == "host_syncs"]
    assert syncs[4].strip() == "skip" and "runs on cuda only" in syncs[6], syncs


def test_the_envelopes_page_is_the_codes() -> None:
    from kda_conformance.cli.backends import builtin_names, envelopes_markdown

    page = REPO / "docs" / "envelopes.md"
    assert page.read_text() == envelopes_markdown(builtin_names()), (
        "docs/envelopes.md is stale: kda-conformance backends --table docs/envelopes.md"
    )


def test_a_plugin_imports_everything_it_needs_from_one_module() -> None:
    import kda_kernels.api as api

    assert sorted(api.__all__) == [
        "Backend", "BackendOutput", "Case", "Envelope", "Gradients", "KDAInputs", "Library", "LibraryTolerance",
        "Support", "Unsupported", "WorkingPrecision", "autograd_backward", "register", "relayout", "stored",
    ]  # fmt: skip
    assert all(hasattr(api, name) for name in api.__all__)
    # The example plugin and the narrow one are written against it alone.
    for plugin in ("kda_example_plugin.py", "kda_narrow.py", "kda_declared.py", "kda_fake_library.py"):
        source = (PLUGINS / plugin).read_text()
        assert "from kda_kernels.api import" in source and "kda_kernels.protocol" not in source, plugin


def test_backends_lists_every_backend_as_json_with_its_library_version_and_why_not(capsys) -> None:
    """A kernel engineer's first question: which backends are there, which run here and why not."""
    from kda_kernels.protocol import Support
    from kda_kernels.torch_chunk import TorchChunk

    class Raises(TorchChunk):
        name = "raises_when_asked"

        def availability(self, device) -> Support:
            raise RuntimeError("asked")

    registry.register("raises_when_asked", Raises)
    try:
        assert main(["backends", "--device", "cpu", "--json"]) == 0
    finally:
        registry.unregister("raises_when_asked")
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert "raised instead of answering" in listed["raises_when_asked"]["error"], "an entry, and the JSON whole"
    assert {"torch_chunk", "fla_chunk", "flashkda_cuda", "aiter_flashkda"} <= set(listed)
    assert listed["torch_chunk"]["runs_here"] and listed["torch_chunk"]["takes"] == "every case"
    assert listed["fla_chunk"]["libraries"] == {"fla-core": "0.6.0"}
    flashkda = listed["flashkda_cuda"]
    assert not flashkda["runs_here"] and "cuda only" in flashkda["why_not"]
    assert flashkda["envelope"]["dtypes"] == "bf16" and flashkda["declared_precision"].startswith("bf16 state")


def test_a_test_id_names_the_case_that_ran_not_the_drawn_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test id named the drawn case (``...-kda-cb6cc21512bb``, K64) while the records and the repro line name
    the case moved into the backend's envelope; the id now names that one."""
    args = [sys.executable, "-m", "pytest", "conformance/test_first_sweep.py", "--collect-only", "-q"]
    args += ["--kda-device", "cpu", "--kda-plugin", "kda_narrow", "--kda-backend", "narrow_correct"]
    env = {**os.environ, "PYTHONPATH": str(PLUGINS)}
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, check=False)
    ids = [line.split("[", 1)[1] for line in done.stdout.splitlines() if "::test_first_sweep[" in line]
    assert ids and all(i.startswith("narrow_correct-") and "K128V128" in i for i in ids), done.stdout[-2000:]
    monkeypatch.syspath_prepend(str(PLUGINS))
    registry.load_plugin("kda_narrow")
    drawn = Case(seq_lens=(37,), num_heads=2, num_v_heads=2, head_k_dim=64, head_v_dim=64)
    ran = registry.get("narrow_correct").fit(drawn)
    assert ran.id != drawn.id and any(ran.id in i for i in ids) and not any(drawn.id in i for i in ids)


def test_a_plugin_whose_supports_refuses_most_cases_is_told_to_declare_an_envelope(tmp_path: Path) -> None:
    """A plugin that overrides ``supports()`` instead of declaring an ``Envelope`` got a bare Hypothesis
    FailedHealthCheck charged to its kernel's test; the test now says it is the plugin's configuration."""
    plugin = tmp_path / "kda_refusing.py"
    plugin.write_text(
        "from kda_kernels.api import register\n"
        "from kda_kernels.protocol import Support\n"
        "from kda_kernels.torch_chunk import TorchChunk\n\n\n"
        "class Refusing(TorchChunk):\n"
        "    name = 'refusing_by_supports'\n\n"
        "    def supports(self, case):\n"
        "        if case.head_k_dim != 96 or case.dtype != 'fp16':\n"
        "            return Support.no(f'takes K = 96 fp16 only (the case has K={case.head_k_dim})')\n"
        "        return Support.yes()\n\n\n"
        "register(Refusing.name, Refusing)\n"
    )
    args = [sys.executable, "-m", "pytest", "conformance/test_properties.py", "-q", "-k", "within_budget"]
    args += ["-p", "no:randomly", "--kda-device", "cpu", "--kda-plugin", str(plugin), "--kda-out", str(tmp_path)]
    done = subprocess.run([*args, "--kda-backend", "refusing_by_supports"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "refusing_by_supports: its supports() refused " in done.stdout
    assert "a configuration problem of the plugin, not a failure of its kernel" in done.stdout
    assert "Declare the cases it takes as its Envelope" in done.stdout and "FailedHealthCheck" not in done.stdout


def test_every_envelope_field_says_what_it_admits_on_the_envelopes_page() -> None:
    """docs/plugins.md never listed Envelope's fields; the envelopes page has a table made from the record."""
    import dataclasses

    assert set(Envelope.MEANINGS) == {f.name for f in dataclasses.fields(Envelope)}
    page = (REPO / "docs" / "envelopes.md").read_text()
    fields = page[page.index("## The fields") :]
    assert all(f"| `{name}` |" in fields for name in Envelope.MEANINGS)
