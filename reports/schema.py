"""The record schema: one row per case x backend x tensor, every column named and explained here once,
and the rows built from findings.

docs/reports.md presents this table; a test holds the records, this schema and
that page to the same column list.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

from kda_cases.case import Case
from kda_reports.findings import VERDICTS, Finding

CASE_COLUMNS = {f"case_{f.name}": f"the case's `{f.name}`" for f in dataclasses.fields(Case)} | {
    "case_total_tokens": "tokens over all sequences",
    "case_num_seqs": "number of sequences",
}

RECORD_COLUMNS: dict[str, str] = {
    "run_id": "the run: UTC start time and a random suffix, sortable",
    "case_id": "stable case id (hash of the case's fields and the generator version)",
    "label": "short readable summary of the case",
    "backend": "registered backend name",
    "device": "torch device the case ran on",
    **CASE_COLUMNS,
    "case_json": "the whole case as JSON (what `--case` takes)",
    "check": "the registered check that made the row (`budget`, `split_resume`, `poison`, ...; docs/checks.md)",
    "subject": "what the check compared or inspected (`o against the whole run`, `in-place metadata`, ...); "
    "empty for the budget check",
    "tensor": "`o`, `final_state` or `checkpoint_states`; empty for a skip, an error or a finding about memory",
    "verdict": "`pass`, `fail`, `skip` (backend or case unsupported), `error` (the backend raised, crashed or hung), "
    "`resource` (the case did not fit the device's memory, even alone), `warn` (reported; fails only under "
    "`--kda-strict`), `known` (a failure the ledger of known issues excuses) or `marginal` (a failure within 1.5 "
    "times its limits that most fresh draws of the case did not confirm: shown, never a failure)",
    "observed": "what the check observed beyond pass or fail: `equal`, `not batch-invariant`, `causal leak`, "
    "`nondeterministic`, `zero`, `untouched`, `values`, `garbage`, `right`, `wrong`, ...",
    "reason": "why it failed, was skipped or raised, or what it did (a warn, a known issue); empty on a pass",
    "known_issue": "the ledger entry of known issues (conformance/known_issues.toml) that matched: on `known` the "
    "issue it reproduces; on a pass an entry that always fails, which did not reproduce on this case",
    "repro": "one shell line that reruns this case on this backend and device",
    "seconds": "wall time of the backend call (synchronized on GPUs)",
    "reference_form": "exact form that produced the truth: `loop` (the definition) or `chunked` (float64)",
    "reference_seconds": "wall time of the float64 truth of this case (computed once, shared by its backends)",
    "max_abs": "max-abs error against the float64 truth (the headline metric); inf for non-finite values",
    "rel_rms": "RMS of the error over RMS of the truth",
    "max_abs_over_ref_rms": "max-abs error over RMS of the truth",
    "nonfinite": "number of NaN or Inf values returned",
    "first_bad": "where it first went wrong: the first point past the max-abs limit, `seq S token T head H` "
    "(outputs), `seq S head H` (states), `checkpoint N (seq S after T tokens) head H` (for a failure of the "
    "rel-RMS limit alone, where the error is largest); or the memory a check found "
    "written, `slot N`, `row R token T head H`",
    "error_curve": "max-abs error per 64 tokens along the packed rows, comma-separated (outputs only)",
    "budget": "max-abs limit from the tolerance rule",
    "ratio": "max_abs / budget",
    "budget_rel_rms": "rel-RMS limit from the tolerance rule",
    "rel_rms_ratio": "rel_rms / budget_rel_rms",
    "budget_baseline": "max-abs error of the same-precision baseline (torch_chunk) on this case",
    "budget_floor": "max-abs rounding floor: (max(u(stored dtype), u(working dtype) / 4) + sqrt(25 + 2 ln N) "
    "sqrt(longest sequence + 128) u(fp32)) x max|truth|, N the tensor's elements",
    "budget_cap": "max-abs cap: sqrt(u(working dtype)) x max|truth|",
    "budget_binding": "which term set the max-abs limit: `baseline`, `floor`, `cap` or `breakdown` (the baseline "
    "itself past the cap: the limit is its own error)",
    "baseline_rel_rms": "rel-RMS error of the same-precision baseline on this case",
    "budget_rel_rms_binding": "which term set the rel-RMS limit",
    "precision": "the working precision the backend declares by its documented design (`bf16 state every 16 "
    "tokens`, `tf32 dots`), whose baseline set this row's limits; '' where it declares none (the limits are the "
    "strict ones)",
    "strict_ratio": "with a declared precision: the worst error/limit against the strict baseline's limits (the "
    "case's own precision), what the design costs apart from the verdict; NaN otherwise",
    "library_tolerance": "the rel-RMS limit the backend's library asserts on this tensor in its own tests (FLA's "
    "tests/ops/test_kda.py: 0.005 on o and the final state; kernels/libraries.py cites each); NaN where it states none",
    "library_ratio": "rel_rms / library_tolerance: the error against what the library's maintainers accept",
    "redraws": "a failure within 1.5 times its limits, judged again on fresh draws of its case (new seeds): what "
    "they gave, `confirmed: 6 of 8 fresh draws of the case failed it (seed N failed 1.2x, ...)` or `not confirmed: "
    "...` (then the verdict is `marginal`); '' where none was made",
    "tier": "how bad a failure is: `broken` (non-finite, a crash, a wrong shape or dtype, memory written that is not "
    "the kernel's, a repeat that moved), `beyond the library's tolerance`, `beyond working precision only` (within "
    "it), `beyond working precision (no library tolerance)`; '' on a pass, a skip or a warning",
    "library": "the library (and version) the backend's kernel comes from, as the backend declares it: "
    "`fla-core 0.6.0`, `vLLM 1a2b3c (KDA_VLLM_SRC)`; '' for the suite's own and undeclared backends",
    "backend_code": "a hash of the Python source that defines the backend (its plugin module, its adapter): a "
    "backend whose code changed between two runs says so in the regressions; '' where no source file was found",
    "test": "pytest node id (pytest runs only)",
    "env_device_type": "`cpu`, `cuda`",
    "env_device_name": "GPU name, or the CPU's model (`/proc/cpuinfo`)",
    "env_arch": "`sm_90`, `gfx950`, ... or the CPU architecture",
    "env_multiprocessors": "SM / CU count (0 on a CPU); FlashKDA's segmentation depends on it",
    "env_python": "Python version",
    "env_torch": "torch version",
    "env_triton": "triton version",
    "env_fla": "fla-core version ('' when absent)",
    "env_aiter": "aiter version ('' when absent)",
    "env_source_trees": "the commit of each kernel source tree a `KDA_*_SRC` variable names (`KDA_AITER_SRC`, "
    "`KDA_VLLM_SRC`, `KDA_SGLANG_SRC`), as JSON keyed by the variable: `git rev-parse` in the tree's own checkout, "
    "else its `COMMIT` file, else `unknown`; `{}` when none is named",
    "env_libraries": "the libraries of the run's backends (each backend declares its own: kernels/libraries.py) "
    "with the version the run used, as JSON: the commit of the source tree its `KDA_*_SRC` variable names where "
    "set, else the installed version, else `not installed`",
    "env_cuda": "CUDA version torch was built with (GPU runs)",
    "env_hip": "HIP version torch was built with (ROCm runs)",
    "env_visible_devices": "GPU runs: the GPUs the process saw (`CUDA_VISIBLE_DEVICES` / `HIP_VISIBLE_DEVICES`; "
    "each pytest-xdist worker sees one of the GPUs it was spread over), '' when unset",
    "env_shard": "`I/N` when the run was split over hosts with `--kda-shard`: the share that wrote the row",
    "env_suite_commit": "this suite's commit, `+dirty` with uncommitted changes; `unknown` where it cannot be read",
    "env_suite_commit_from": "where the commit was read: `KDA_SUITE_COMMIT` (it overrides the rest), `git` (the "
    "project's own checkout only), `package metadata` (a pip install from a repository) or `unknown`",
    "env_variables": "the environment variables set that can change a kernel's numbers or path, as JSON: every "
    "`TRITON_*`, `TORCH_*`, `CUDA_*`, `HIP_*`, `ROCM_*`, `HSA_*`, `AITER_*`, `FLA_*`, `KDA_*`, cuBLAS/hipBLASLt, "
    "oneDNN, thread counts, `MKL_CBWR`, `ATEN_CPU_CAPABILITY` (paths and caches left out; a value whose name "
    "says credential, such as `*_TOKEN`, `*_KEY` or `*_PASS`, is `<redacted>`, and so is a URL's user and "
    "password in any value; reports/environment.py)",
    "env_hostname": "machine name",
    "env_date": "UTC time the run started, ISO 8601",
    "env_run_id": "the run id again, as stored in the environment file",
    "env_complete": "False when the run was interrupted (Ctrl-C, a time limit) and holds only what was measured",
    "env_profile": "sweep profile (`smoke`, `ci`, `nightly`, `long`) of a profile run",
    "env_seed": "seed of a randomized profile's draw ('' when derandomized), or of the first sweep's cases "
    "(`run --seed`); rerun with it to get the same cases",
    "env_command": "the command line that produced the run (`kda-conformance ...` or `pytest ...`)",
    "env_purpose": "what made the run: a sweep (`sweep`, `nightly`, `pytest`), judged by the dashboard's headline "
    "and regressions, or a run kept apart (`cases`: a repro line pasted, `minimize`, `repro`, `detection`, "
    "`triage`, `calibrate`, `checks`, `findings`)",
    "env_baseline": "`module.Class` of the baseline backend (`torch_chunk`) every limit derived from; "
    "`kda_kernels.torch_chunk.TorchChunk` unless a plugin replaced it",
}


def case_columns(case: Case) -> dict:
    """The case's fields as flat ``case_*`` columns (lists joined, missing numbers as NaN)."""
    data = case.to_dict()
    data["seq_lens"] = ",".join(str(n) for n in case.seq_lens)
    data["checkpoints"] = ";".join(f"{s}:{p}" for s, p in case.checkpoints)
    data["tags"] = ",".join(case.tags)
    data["lower_bound"] = math.nan if case.lower_bound is None else case.lower_bound
    data["scale"] = math.nan if case.scale is None else case.scale
    data["total_tokens"] = case.total_tokens
    data["num_seqs"] = case.num_seqs
    return {f"case_{k}": v for k, v in data.items()}


def record_row(finding: Finding) -> dict:
    """One finding as a record: the case, the backend, and for a judged tensor its errors and limits."""
    case = finding.case
    row = {
        "case_id": case.id,
        "label": case.label,
        "backend": finding.backend,
        "device": finding.device,
        "check": finding.check,
        "subject": finding.subject,
        "observed": finding.observed,
        "known_issue": finding.known_issue,
        **case_columns(case),
        "case_json": case.to_json(),
        "seconds": finding.seconds,
        # Why it failed (every problem, a finding about memory's as well as a tensor's), or what it did.
        "reason": "; ".join(finding.problems) or finding.reason,
        "first_bad": "" if finding.first_bad is None else str(finding.first_bad),
        "repro": finding.repro,
        "reference_form": finding.reference_form,
        "reference_seconds": finding.reference_seconds,
    }
    errors, budget = finding.errors, finding.budget
    row["tier"] = finding.tier
    row["redraws"] = finding.redraws
    if errors is None or budget is None:
        return {**row, "tensor": finding.tensor, "verdict": finding.verdict}
    return {
        **row,
        "tensor": finding.tensor,
        "verdict": finding.verdict,
        "library_tolerance": finding.library_tolerance,
        "library_ratio": finding.library_ratio,
        "budget": budget.max_abs.value,
        "ratio": finding.ratio,
        "budget_rel_rms": budget.rel_rms.value,
        "rel_rms_ratio": finding.rel_rms_ratio,
        "max_abs": errors.max_abs,
        "rel_rms": errors.rel_rms,
        "max_abs_over_ref_rms": errors.max_abs_over_ref_rms,
        "nonfinite": errors.nonfinite,
        "error_curve": ",".join(f"{x:.3g}" for x in errors.curve),
        "budget_baseline": budget.max_abs.baseline,
        "budget_floor": budget.max_abs.floor,
        "budget_cap": budget.max_abs.cap,
        "budget_binding": budget.max_abs.binding,
        "baseline_rel_rms": budget.rel_rms.baseline,
        "budget_rel_rms_binding": budget.rel_rms.binding,
        "precision": budget.precision,
        "strict_ratio": finding.strict_worst,
    }


def record_rows(findings: Sequence[Finding], test: str | None = None) -> list[dict]:
    """The records of a check's findings; ``test`` (a pytest node id) goes into each row."""
    rows = [record_row(f) for f in findings]
    return rows if test is None else [{**row, "test": test} for row in rows]


# What a row must hold to be a record at all; the store skips (and names) rows and files without them.
REQUIRED_COLUMNS = ("case_id", "backend", "verdict")
# Every column's kind, for validating rows read back (a journal hand-edited, a file from another tool):
# text, a number (NaN and inf allowed), a flag, or any scalar (the environment's values). Missing (null)
# is allowed everywhere but in the required columns.
NUMBER_COLUMNS = (
    "seconds",
    "reference_seconds",
    "max_abs",
    "rel_rms",
    "max_abs_over_ref_rms",
    "nonfinite",
    "budget",
    "ratio",
    "budget_rel_rms",
    "rel_rms_ratio",
    "budget_baseline",
    "budget_floor",
    "budget_cap",
    "baseline_rel_rms",
    "strict_ratio",
    "library_tolerance",
    "library_ratio",
    "env_multiprocessors",
)
FINITE_COLUMNS = ("seconds", "reference_seconds")  # times: a NaN or an infinity is not a time
FLAG_COLUMNS = ("env_complete",)
SCALAR_COLUMNS = tuple(c for c in RECORD_COLUMNS if c.startswith("env_") and c not in ("env_date", "env_complete"))
# The case's own columns: their kinds from a case's row (lists are joined into text).
_CASE_KINDS = {
    name: "flag" if isinstance(value, bool) else "number" if isinstance(value, int | float) else "text"
    for name, value in case_columns(Case(seq_lens=(1,))).items()
}
# Text a reader parses: comma-separated lengths, "seq:position" pairs.
PATTERNS = {"case_seq_lens": r"^\d+(,\d+)*$", "case_checkpoints": r"^(\d+:\d+(;\d+:\d+)*)?$"}
PATTERN_WORDS = {"case_seq_lens": "comma-separated lengths", "case_checkpoints": "seq:position pairs"}
KIND_WORDS = {"text": "text", "number": "a number", "flag": "true or false", "scalar": "a single value"}


def column_kind(column: str) -> str | None:
    """``text``, ``number``, ``flag`` or ``scalar``; None for a column the schema does not know."""
    if column in _CASE_KINDS:
        return _CASE_KINDS[column]
    if column in NUMBER_COLUMNS:
        return "number"
    if column in FLAG_COLUMNS:
        return "flag"
    if column in SCALAR_COLUMNS:
        return "scalar"
    return "text" if column in RECORD_COLUMNS else None


# What pandas infers for a column that is wholly of a kind (nulls skipped).
FITTING = {
    "text": ("string", "empty"),
    "number": ("floating", "integer", "mixed-integer-float", "empty"),
    "flag": ("boolean", "empty"),
    "scalar": ("string", "floating", "integer", "mixed-integer-float", "boolean", "empty"),
}


def _fits(value: object, kind: str) -> bool:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return True
    if kind == "text":
        return isinstance(value, str)
    if kind == "flag":
        return isinstance(value, bool | np.bool_)
    if kind == "number":
        return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool | np.bool_)
    return isinstance(value, str | int | float | bool | np.generic)  # scalar


def validate_records(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The rows of ``frame`` that are records, field by field, and why the others are not (one line per
    reason, with how many rows): a required column missing or empty, a verdict that is not one, a value of
    the wrong kind, a time that is not finite, case text a reader cannot parse, case JSON that is not a
    case. Number columns come back as floats."""
    if frame.empty:
        return frame, []
    reasons: dict[str, pd.Series] = {}
    for column in REQUIRED_COLUMNS:
        values = frame[column] if column in frame else pd.Series(None, index=frame.index)
        reasons[f"no {column}"] = ~values.map(lambda v: isinstance(v, str) and v != "")
    if "verdict" in frame:
        known = frame["verdict"].map(lambda v: isinstance(v, str) and v in VERDICTS).astype(bool)
        reasons[f"a verdict that is not one of {', '.join(VERDICTS)}"] = ~known & ~reasons["no verdict"]
    for column in frame.columns:
        kind = column_kind(column)
        if kind is None or column in REQUIRED_COLUMNS:
            continue
        if pd.api.types.infer_dtype(frame[column], skipna=True) in FITTING[kind]:
            bad = pd.Series(False, index=frame.index)  # the whole column is of its kind (the common case)
        else:
            bad = ~frame[column].map(lambda v, kind=kind: _fits(v, kind)).astype(bool)
        if bad.any():
            reasons[f"{column} is not {KIND_WORDS[kind]}"] = bad
        if column in FINITE_COLUMNS:
            numbers = pd.to_numeric(frame[column].where(~bad), errors="coerce")
            reasons[f"{column} is not finite"] = frame[column].notna() & ~bad & ~np.isfinite(numbers.fillna(0.0))
        if column in PATTERNS:
            unreadable = frame[column].map(lambda v, c=column: isinstance(v, str) and not re.match(PATTERNS[c], v))
            reasons[f"{column} is not {PATTERN_WORDS[column]}"] = unreadable
    if "case_json" in frame:
        parses = {}
        for text in {v for v in frame["case_json"] if isinstance(v, str)}:
            try:
                Case.from_json(text)
                parses[text] = True
            except Exception:  # any way a text can fail to be a case
                parses[text] = False
        reasons["case_json is not a case"] = frame["case_json"].map(lambda v: isinstance(v, str) and not parses[v])
    bad = pd.Series(False, index=frame.index)
    problems = []
    for reason, rows in reasons.items():
        rows = rows.astype(bool) & ~bad  # each skipped row named once, by its first reason
        if rows.any():
            problems.append(f"{int(rows.sum())} row(s) skipped: {reason}")
        bad |= rows
    valid = frame[~bad].reset_index(drop=True)
    for column in valid.columns:
        if column_kind(column) == "number":
            valid[column] = pd.to_numeric(valid[column], errors="coerce").astype(float)
    return conform_records(valid), problems


def conform_records(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every schema column: a run of skips alone has no error columns of its own, and readers
    (the summary, the dashboard) may rely on every column being there."""
    missing = [c for c in RECORD_COLUMNS if c not in frame.columns]
    if not missing:
        return frame
    return pd.concat([frame, pd.DataFrame(math.nan, index=frame.index, columns=missing)], axis=1)
