"""The checks that see what servers do: cu_seqlens reused three ways, host metadata passed in, padded tails,
prefix invariance in two tiers, determinism, and the ledger of known issues. Planted backends (each the
correct baseline but for one behaviour) show each outcome on the CPU."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from suite_paths import plugins_on_path

from kda_cases.case import Case
from kda_conformance.checks import get_check, run_check
from kda_conformance.judging.known import KnownIssue, apply_known, load_ledger
from kda_conformance.running.config import build_config
from kda_kernels import registry
from kda_reports.findings import Budget, Errors, Finding, Limit, stale_known_issues
from kda_reports.schema import record_rows

CPU = torch.device("cpu")
PACKED = Case(seq_lens=(20, 0, 90), packed=True, num_heads=1, num_v_heads=1, head_k_dim=32, head_v_dim=32)


@pytest.fixture(scope="module", autouse=True)
def backends(planted_zoo: dict) -> Iterator[None]:
    # On sys.path for the whole module: the host-metadata check probes stale metadata in a spawned process,
    # which imports the backend's module again.
    with plugins_on_path():
        import kda_behaviours  # noqa: F401  (registers the backends)

        yield


def check(name: str, backend: str, case: Case, **params: object) -> list[Finding]:
    return run_check(get_check(name), case, registry.get(backend), CPU, params)


def observed(findings: list[Finding], subject: str) -> set[str]:
    return {f.observed for f in findings if f.subject.startswith(subject)}


def test_cu_seqlens_is_reused_three_ways_and_the_identity_cache_fails_in_place_only() -> None:
    correct = check("cu_seqlens", "torch_chunk", PACKED)
    assert all(f.passed for f in correct)
    assert {f.observed for f in correct} == {
        "right under in-place metadata",
        "right under persistent buffer, sliced afresh",
        "right under fresh tensor",
    }
    cached = check("cu_seqlens", "planted_cu_seqlens_identity_cache", PACKED)
    wrong = {f.observed for f in cached if f.failed}
    assert wrong == {"wrong under in-place metadata"}
    assert any("in-place metadata contract broken" in f.message() for f in cached if f.failed)


def test_a_write_into_an_input_under_in_place_metadata_is_named_under_that_pattern() -> None:
    """On an H100, FLA's and SGLang's kernels wrote into their input beta when a second batch's bounds came
    in place through the same cu_seqlens tensor (stale chunk indices): the breach was recorded without the
    pattern that made it, so the ledger's in-place entry could not claim it and the page called it new."""
    from kda_planted_bugs import CuSeqlensIdentityCache

    class WritesBetaUnderStaleBounds(CuSeqlensIdentityCache):
        name = "test_writes_beta_under_stale_bounds"

        def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
            kept = self.cached.get(id(batch.cu_seqlens))
            stale = kept is not None and not torch.equal(kept[1], batch.cu_seqlens)
            super().run_paged(batch, pool, state_indices, has_initial_state, out, checkpoint_slots)
            if stale:  # where a kernel with stale bounds writes: past its output, into its neighbour
                batch.beta.view(-1)[0] = float("nan")

    registry.register(WritesBetaUnderStaleBounds.name, WritesBetaUnderStaleBounds, replace=True)
    try:
        findings = check("cu_seqlens", WritesBetaUnderStaleBounds.name, PACKED)
    finally:
        registry.unregister(WritesBetaUnderStaleBounds.name)
    failed = [f for f in findings if f.failed]
    # Its stale outputs, as the identity cache's, and its write, each under the pattern that made them.
    assert {f.observed for f in failed} == {"wrong under in-place metadata", "broke the call contract under "
                                            "in-place metadata"}, failed  # fmt: skip
    [breach] = [f for f in failed if f.observed.startswith("broke")]
    assert "wrote into its input beta" in breach.message()
    assert "in-place metadata contract broken" in breach.message()
    assert {f.observed for f in findings if f.passed} >= {"right under fresh tensor"}


def test_host_metadata_passed_in_is_bitwise_the_derived_and_stale_metadata_is_refused_or_reported() -> None:
    taken = check("host_metadata", "test_takes_host_bounds", PACKED)
    assert [(f.verdict, f.observed) for f in taken] == [("pass", "equal"), ("warn", "used silently")]
    assert "off the truth by max-abs" in taken[1].reason
    checked = check("host_metadata", "test_checks_host_bounds", PACKED)
    assert [(f.verdict, f.observed) for f in checked] == [("pass", "equal"), ("pass", "refused")]
    assert "ValueError: cu_seqlens_cpu does not match cu_seqlens" in checked[1].reason


@pytest.mark.slow
def test_host_metadata_that_differs_says_which_result_is_wrong() -> None:
    # Right with the host's bounds and wrong without them (SGLang's graph tables beside its own derivation
    # on a zero-length member): a warning that names the derived result as the wrong one.
    derived_wrong = check("host_metadata", "test_wrong_when_derived", PACKED)
    differs = derived_wrong[0]
    assert (differs.verdict, differs.observed) == ("warn", "differs: derived wrong")
    assert "the derived one is off the truth by max-abs 5.0" in differs.reason
    assert not any(f.failed for f in derived_wrong), "the passed-in result is within its limits"
    # Off with the host's bounds too, but 100 times closer to the truth than the derived result (SGLang's
    # graph tables in fp32 on the H200): the difference is still the derived one's; the passed-in result's
    # own error fails in its own rows.
    far = check("host_metadata", "test_far_wrong_when_derived", PACKED)
    assert (far[0].verdict, far[0].observed) == ("warn", "differs: derived wrong")
    assert "the passed-in one is outside its limits too (judged below; max-abs " in far[0].reason
    judged = [f for f in far if f.subject.startswith("the result with cu_seqlens_cpu passed in")]
    assert {f.tensor for f in judged if f.failed} == {"o"}
    # Wrong with the host's bounds: the difference fails, and so does the passed-in result against the truth.
    passed_wrong = check("host_metadata", "test_wrong_when_passed", PACKED)
    assert (passed_wrong[0].verdict, passed_wrong[0].observed) == ("fail", "differs")
    judged = [f for f in passed_wrong if f.subject.startswith("the result with cu_seqlens_cpu passed in")]
    assert {f.tensor for f in judged if f.failed} == {"o"}


def test_padded_tails_are_classified_and_garbage_fails_only_when_strict() -> None:
    zero = check("padded_tail", "torch_chunk", PACKED)
    assert all(f.passed for f in zero) and observed(zero, "output rows past") == {"zero"}
    paged = check("padded_tail", "planted_padding_writes_slot0", PACKED)  # a paged API; its output rows are right
    assert observed(paged, "output rows past") == {"untouched"}  # the caller's buffer past the tokens
    # Rows of the caller's buffer left as the caller filled them are the caller's, not garbage.
    kept = check("padded_tail", "test_caller_buffer_tail", PACKED)
    assert observed(kept, "output rows past") == {"untouched"} and all(f.passed for f in kept)
    garbage = check("padded_tail", "test_garbage_tail", PACKED)
    [tail] = [f for f in garbage if f.subject.startswith("output rows past")]
    assert tail.verdict == "warn" and tail.observed == "garbage" and "non-finite" in tail.reason
    assert all(f.passed for f in garbage if f is not tail), "the sequences' own answer is right"
    assert not build_config(device="cpu").fails(tail) and build_config(device="cpu", strict=True).fails(tail)


def test_prefix_invariance_tells_a_causal_leak_from_batch_variance_and_from_nondeterminism() -> None:
    case = Case(seq_lens=(150,))
    [leak] = check("prefix", "planted_future_leak", case, at=100)
    assert leak.verdict == "fail" and leak.observed == "causal leak"
    [hair] = check("prefix", "test_not_batch_invariant", case, at=100)
    assert hair.verdict == "warn" and hair.observed == "not batch-invariant"
    assert "inside the 64-token chunk that holds token 100 (from 64)" in hair.reason
    assert not build_config(device="cpu").fails(hair)
    assert build_config(device="cpu", batch_invariant=True).fails(hair)
    # Within the limit it is rounding wherever it starts (a correct kernel at 16- or 32-token chunks moved token 0
    # when tokens from 55 on changed): reported as not batch-invariant, saying where it starts.
    [far] = check("prefix", "test_tiny_far_leak", case, at=100)
    assert far.verdict == "warn" and far.observed == "not batch-invariant"
    assert "tokens before the 64-token chunk that holds token 100" in far.reason
    # A backend that varies by itself is judged to the o limit, not bitwise: noise within it is the warning,
    # a change past it (and past its own noise) from later tokens is still a leak.
    [varies] = check("prefix", "test_nondeterministic", case, at=100)
    assert varies.verdict == "warn" and varies.observed == "nondeterministic"
    assert re.search(r"outputs before the token moved by later inputs within \S+$", varies.reason)
    [leaks] = check("prefix", "test_nondeterministic_leak", case, at=100)
    assert leaks.verdict == "fail" and leaks.observed == "causal leak"
    assert "when only later inputs changed, beyond what the backend varies by itself" in leaks.problems[0]


def test_determinism_is_checked_and_poison_is_not_blamed_on_a_backend_that_varies() -> None:
    [same] = check("determinism", "torch_chunk", PACKED)
    assert same.passed and same.observed == "deterministic"
    varies, *calls = check("determinism", "test_nondeterministic", PACKED)
    assert varies.verdict == "warn" and re.search(r"o by max-abs \S+ \(\S+ of its limit\)$", varies.reason)
    assert {f.subject for f in calls} == {"the first call", "the second call"} and all(f.passed for f in calls)
    poison = check("poison", "test_nondeterministic", PACKED, poison="nan")
    assert [f.observed for f in poison if f.verdict == "warn"] == ["nondeterministic"]
    assert not any(f.failed for f in poison if f.subject != "clean run")
    assert {"second clean run", "nan poison"} <= {f.subject for f in poison}, "judged against the truth instead"


def test_a_repeat_outside_the_budget_fails_naming_the_call() -> None:
    # A kernel that keeps a state between calls: the second call of the same inputs is 0.05 off, 20 times
    # the o limit. Not noise: a wrong answer, with its first bad point.
    varies, *calls = check("determinism", "test_state_between_calls", PACKED)
    assert varies.verdict == "warn" and varies.observed == "nondeterministic"
    wrong = [f for f in calls if f.failed]
    assert {f.subject for f in wrong} == {"the second call"} and {f.tensor for f in wrong} == {"o"}
    assert wrong[0].first_bad is not None and wrong[0].ratio > 10
    assert all(f.passed for f in calls if f.subject == "the first call")
    poison = check("poison", "test_state_between_calls", PACKED, poison="nan")
    assert {f.subject for f in poison if f.failed} >= {"second clean run"}


def _finding(verdict: str, ratio: float, **case_fields: object) -> Finding:
    limit = Limit("max_abs", 1.0, 1.0, 0.0, 1.0, "baseline")
    budget = Budget("o", limit, dataclasses.replace(limit, metric="rel_rms"))
    errors = Errors(ratio, 0.0, ratio, 0, True)
    case = Case(seq_lens=(40,), **case_fields)
    return Finding("budget", case, "fla_chunk", "cuda", verdict, tensor="o", errors=errors, budget=budget)


def test_the_known_issues_ledger_excuses_tracks_and_retires(monkeypatch: pytest.MonkeyPatch) -> None:
    issue = KnownIssue(
        id="tf32",
        backends=("fla_chunk",),
        description="TF32 dots",
        upstream="docs/tolerance.md",
        added="2026-11-30",
        worst=100.0,
        growth=1.5,
        device="cuda",
        when={"dtype": ("fp32",)},
        environment={"TRITON_F32_DEFAULT": ("", "tf32")},
    )
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    [known] = apply_known([_finding("fail", 120.0, dtype="fp32")], [issue])
    assert known.verdict == "known" and known.observed == "known: tf32" and not known.failed
    [worse] = apply_known([_finding("fail", 151.0, dtype="fp32")], [issue])
    assert worse.verdict == "fail" and "worse than known issue tf32 allows" in worse.problems[-1]
    [passed] = apply_known([_finding("pass", 0.5, dtype="fp32")], [issue])
    assert passed.verdict == "pass" and passed.known_issue == "tf32"  # the run tells whether it reproduced
    [other] = apply_known([_finding("fail", 120.0, dtype="bf16")], [issue])
    assert other.verdict == "fail"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    [ieee] = apply_known([_finding("fail", 120.0, dtype="fp32")], [issue])
    assert ieee.verdict == "fail", "with IEEE dots the entry does not apply"
    # A second entry that matches the same failure and allows it: the failure is that entry's, not a
    # failure "worse than" the first one (on the H200 FLA's in-place cu_seqlens failure at fp16 with strong
    # gates matched the fp16 rounding entry first).
    monkeypatch.delenv("TRITON_F32_DEFAULT")
    contract = dataclasses.replace(issue, id="contract", worst=math.inf, growth=1.0, always_fails=False)
    [either] = apply_known([_finding("fail", 151.0, dtype="fp32")], [issue, contract])
    assert either.verdict == "known" and either.observed == "known: contract"
    [widest] = apply_known([_finding("fail", 1e9, dtype="fp32")], [issue, dataclasses.replace(contract, worst=200.0)])
    assert "worse than known issue contract allows: 1e+09 of the limit > 200" in widest.problems[-1]


def test_an_entry_is_known_for_its_case_and_retired_only_over_a_whole_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry matches an issue, not a tensor: a case whose o reproduces it while its final state passes is
    known, not a failure (on the H200 fla_chunk failed four tests for having one tensor right). It no longer
    reproduces only when every case it matched in the run passed: a warning, not a failure of the case."""
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    glm5 = next(i for i in load_ledger() if i.id == "vllm-glm5-fp32-tf32-default")
    issue = dataclasses.replace(glm5, id="fla-chunk-fp32-tf32", backends=("fla_chunk",))  # always fails, fp32
    state = dataclasses.replace(_finding("pass", 0.3, dtype="fp32"), tensor="final_state")
    one_case = apply_known([_finding("fail", 59.0, dtype="fp32"), state], [issue])
    assert [f.verdict for f in one_case] == ["known", "pass"] and not any(f.failed for f in one_case)
    rows = pd.DataFrame(record_rows(one_case))
    assert stale_known_issues(rows).empty  # it reproduced on this case's o
    passing = pd.DataFrame(record_rows(apply_known([_finding("pass", 0.5, dtype="fp32"), state], [issue])))
    assert stale_known_issues(passing).to_dict("records") == [
        {"known_issue": "fla-chunk-fp32-tf32", "backends": "fla_chunk", "cases": 1}
    ]
    assert stale_known_issues(pd.concat([passing, rows])).empty  # one case of the run reproduced it


def test_an_observation_without_a_ratio_is_known_beside_the_error_its_entry_allows() -> None:
    """A graph replay that differs from its eager call is one row without a ratio and comes with the replay's
    errors against the truth: where an entry allows those errors on this case, the difference is the same cause
    and known (on an H100, night-1217, AITER's FlashKDA path was known at 241x while its "replay differs from the
    eager call" row made a new finding of its own). Alone, or beside an error past the entry's bound, it stays
    a failure."""
    issue = KnownIssue(
        id="stale-boundaries",
        backends=("fla_chunk",),
        description="a replay gives the captured batch's answer",
        upstream="-",
        added="2026-12-07",
        worst=241.0,
        growth=1.5,
        device="cuda",
    )
    differs = Finding("graph_replay", Case(seq_lens=(40,)), "fla_chunk", "cuda", "fail", reason="the replay differs")
    both = apply_known([differs, _finding("fail", 241.0)], [issue])
    assert [f.verdict for f in both] == ["known", "known"] and both[0].known_issue == "stale-boundaries"
    [alone] = apply_known([differs], [issue])
    assert alone.verdict == "fail"
    beyond = apply_known([differs, _finding("fail", 400.0)], [issue])
    assert [f.verdict for f in beyond] == ["fail", "fail"]


def test_a_design_a_library_states_is_declared_not_in_the_ledger() -> None:
    """TF32 dots that FLA, AITER's default pipeline, Kimi K3's copy and SGLang choose in their own code are
    declared working precisions (their cost shown apart); the GLM-5.3-Flash copies, which ask for IEEE, keep a
    ledger entry."""
    ids = {issue.id for issue in load_ledger()}
    assert not ids & {"fla-chunk-fp32-tf32", "aiter-default-fp32-tf32", "servers-fp32-tf32"}
    declared = {name for name in registry.names() if (registry.get(name).working_precision or None) is not None}
    assert {"fla_chunk", "fla_chunk32", "aiter_default", "vllm_chunk", "sglang_chunk"} <= declared
    assert not {"vllm_glm5_chunk", "vllm_glm5_chunk_amd", "vllm_kimi_chunk_amd"} & declared
    assert next(i for i in load_ledger() if i.id == "vllm-glm5-fp32-tf32-default").backends == (
        "vllm_glm5_chunk",
        "vllm_glm5_chunk_amd",
    )


def test_the_committed_ledger_loads_and_a_bad_entry_is_named(tmp_path: Path) -> None:
    ids = {issue.id for issue in load_ledger()}
    assert {"fla-kernels-fp16-strong-gates", "tensor-cache-in-place-cu-seqlens"} <= ids
    assert math.isinf(next(i for i in load_ledger() if i.id == "tensor-cache-in-place-cu-seqlens").worst)
    bad = tmp_path / "ledger.toml"
    bad.write_text('[[issue]]\nid = "x"\nbackends = ["a"]\ncolour = "red"\n')
    with pytest.raises(ValueError, match=r"ledger.toml: issue 1 \(x\) is not valid"):
        load_ledger(bad)
