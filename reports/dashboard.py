"""The tolerance dashboard: one self-contained HTML page built from a run store.

Sections: overview (runs, pass/fail per backend, the last run's environment), error against length per
backend and tensor (log-log, each case's limit drawn beside its error), trends of the worst error/limit
ratio per case family over nights, the regression table with each row's repro command, and the worst
cases of the last run. Plotly's JavaScript is inlined once, so the page needs no network when viewed;
plots resize with the window and tables scroll sideways on a narrow screen.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from kda_cases.files import atomic_write
from kda_cases.sentinels import SENTINEL_GROWTH
from kda_reports.environment import SUITE_BASELINE
from kda_reports.findings import TIERS, VERDICTS, stale_known_issues
from kda_reports.history import cell_history, red_first
from kda_reports.precision import precision_costs
from kda_reports.reach import MISSED, backend_coverage
from kda_reports.regressions import GROUP, find_regressions, longest, nightly_groups, record_worst, sentinel_worst
from kda_reports.runfile import record_coverage
from kda_reports.store import COMPLETE, Store

STYLE = """
body { font-family: system-ui, sans-serif; margin: 0 auto; padding: 0 12px; max-width: 1600px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 0.85em; word-break: break-all; }
.fail { color: #b00020; font-weight: 600; } .pass { color: #1b7f3b; } .note { color: #666; font-size: 0.9em; }
.warn { color: #a05a00; }
#status { font-size: 1.1em; padding: 6px 10px; border-left: 6px solid; }
#status.pass { border-color: #1b7f3b; background: #eef8f0; }
#status.fail { border-color: #b00020; background: #fdeef0; }
.plot { width: 100%; min-height: 360px; }
details code { display: block; max-width: 60ch; }
"""


# The colour of a verdict's count in a table of counts per verdict (a failure red, a pass green).
COUNT_CLASS = {"fail": "fail", "error": "fail", "pass": "pass", "known": "warn", "warn": "warn", "marginal": "warn"}


def _table(frame: pd.DataFrame, table_id: str, code_columns: tuple[str, ...] = ()) -> str:
    if frame.empty:
        return f'<p class="note" id="{table_id}">none</p>'
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    rows = []
    for _, row in frame.iterrows():
        cells = []
        for column, value in row.items():
            if column in COUNT_CLASS and isinstance(value, int | np.integer) and not isinstance(value, bool):
                cls = f' class="num {COUNT_CLASS[column]}"' if value else ' class="num"'
                cells.append(f"<td{cls}>{value}</td>")
            elif isinstance(value, float):
                text = "" if math.isnan(value) else ("inf" if math.isinf(value) else f"{value:.3g}")
                cells.append(f'<td class="num">{text}</td>')
            elif column in code_columns:  # long commands fold away, so a narrow screen keeps short rows
                code = f"<code>{html.escape(str(value))}</code>" if value else ""
                cells.append(f"<td><details><summary>{column}</summary>{code}</details></td>" if code else "<td></td>")
            else:
                cls = f' class="{value}"' if value in ("fail", "pass") else ""
                cells.append(f"<td{cls}>{html.escape(str(value))}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    table = f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    return f'<div class="scroll">{table}</div>'


class Plots:
    """The page's plots: Plotly's script loaded once, with the first one drawn, from ``plotly.min.js`` beside
    the page (:func:`write_plotly_beside`: inlined, its 4.8 MB made a night's page 5.7 MB); a note in place
    of a plot with nothing to draw."""

    def __init__(self) -> None:
        self.drawn = 0

    def html(self, figure: go.Figure, div_id: str, empty: str) -> str:
        if not figure.data:
            return f'<p class="note" id="{div_id}">{html.escape(empty)}</p>'
        # Readable at 420 px too: the legend below the plot (at the side it took half a phone's width), the
        # toolbar down the side (across the top it covered the title), run labels slanted (level, they ran
        # into each other).
        figure.update_layout(
            margin=dict(l=50, r=30, t=50, b=40), height=480, title=dict(x=0, xanchor="left", font=dict(size=14)),
            legend=dict(font=dict(size=10), orientation="h", yanchor="top", y=-0.25, x=0),
            modebar=dict(orientation="v"),
        )  # fmt: skip
        figure.update_xaxes(automargin=True, tickangle=-30)
        self.drawn += 1
        return figure.to_html(
            full_html=False,
            include_plotlyjs="directory" if self.drawn == 1 else False,
            div_id=div_id,
            config={"responsive": True, "displaylogo": False},
            default_width="100%",
        )


PLOTLY_JS = "plotly.min.js"  # the name Plotly's include_plotlyjs="directory" loads
PALETTE = plotly.colors.qualitative.D3
FAIL_COLOUR = "#b00020"


def _ceiling(values: pd.Series) -> float:
    """Where a plot draws non-finite values: ten times the largest finite one (1e3 if there is none)."""
    finite = values[values.map(lambda v: math.isfinite(v)).astype(bool)] if len(values) else values
    return 10.0 * float(finite.max()) if len(finite) and finite.max() > 0 else 1e3


def _non_finite_trace(x: list, y: float, text: list[str], name: str) -> go.Scatter:
    return go.Scatter(
        x=x,
        y=[y] * len(x),
        mode="markers",
        name=name,
        text=text,
        marker=dict(symbol="x", size=11, color=FAIL_COLOUR),
    )


def night_labels(runs: pd.DataFrame) -> dict[str, str]:
    """Each run as its axis label: its start, to the minute, and its id (one category per night)."""
    dates = runs["env_date"] if "env_date" in runs else pd.Series("", index=runs.index)
    pairs = zip(runs["run_id"], dates, strict=True)
    return {run_id: f"{str(date)[:16].replace('T', ' ')} {run_id}" for run_id, date in pairs}


def error_vs_length(records: pd.DataFrame) -> go.Figure:
    """Max-abs error against the longest sequence, per backend and tensor, with each case's limit."""
    figure = go.Figure()
    budget = records["check"] == "budget" if "check" in records else True
    judged = records["verdict"].isin(["pass", "fail", "known", "marginal"])
    measured = records[judged & records["max_abs"].notna() & budget].copy()
    measured["length"] = longest(measured)
    non_finite = ~measured["max_abs"].map(math.isfinite).astype(bool)
    if non_finite.any():  # the worst failures: drawn at a marked ceiling, not dropped by the log axis
        ceiling = _ceiling(pd.concat([measured["max_abs"], measured["budget"]]))
        bad = measured[non_finite]
        text = list((bad["backend"] + " " + bad["tensor"] + " " + bad["label"].astype(str)).map(html.escape))
        figure.add_trace(_non_finite_trace(list(bad["length"]), ceiling, text, f"non-finite (drawn at {ceiling:.3g})"))
        measured = measured[~non_finite]
    for index, ((backend, tensor), part) in enumerate(measured.groupby(["backend", "tensor"])):
        part = part.sort_values("length")
        colour = PALETTE[index % len(PALETTE)]  # a series and its limits in one colour
        label = html.escape(f"{backend} {tensor}")  # the page's text: a tag or a label is never markup
        text = (part["case_id"].astype(str) + " " + part["label"].astype(str)).map(html.escape)
        figure.add_trace(
            go.Scatter(
                x=part["length"], y=part["max_abs"], mode="markers", name=label, text=text, legendgroup=label,
                marker=dict(color=colour),
            )
        )  # fmt: skip
        figure.add_trace(
            go.Scatter(
                x=part["length"], y=part["budget"], mode="markers", name=f"{label} limit", text=text,
                legendgroup=label, showlegend=False, marker=dict(symbol="line-ew-open", size=12, color=colour),
            )
        )  # fmt: skip
    failing = measured[measured["verdict"] == "fail"]
    if len(failing):  # ringed in red over their series' points: a failure is seen without reading the legend
        text = (failing["backend"] + " " + failing["tensor"] + " " + failing["label"].astype(str)).map(html.escape)
        figure.add_trace(
            go.Scatter(
                x=failing["length"], y=failing["max_abs"], mode="markers", name="over its limit", text=list(text),
                marker=dict(symbol="circle-open", size=15, color=FAIL_COLOUR, line=dict(width=2)),
            )
        )  # fmt: skip
    figure.update_xaxes(type="log", title="longest sequence (tokens)")
    figure.update_yaxes(type="log", title="max-abs error (its limit: a dash of its colour)")
    figure.update_layout(title="Error against length (the budget check), last run")
    return figure


def trends(groups: pd.DataFrame, runs: pd.DataFrame) -> go.Figure:
    """Worst error/limit ratio per backend x family x tensor over the runs (1 is the limit)."""
    figure = go.Figure()
    order = {run_id: i for i, run_id in enumerate(runs["run_id"])}
    nights = night_labels(runs)
    groups = groups[groups["run_id"].isin(order)].copy()
    groups["night"] = groups["run_id"].map(order)
    ceiling = _ceiling(groups["worst"])
    finite = groups["worst"].map(math.isfinite).astype(bool)
    for key, part in groups[finite].groupby(GROUP):
        part = part.sort_values("night")
        name = html.escape(" ".join(str(k) for k in key))
        x = [nights[r] for r in part["run_id"]]
        figure.add_trace(go.Scatter(x=x, y=part["worst"], mode="lines+markers", name=name))
    bad = groups[~finite]
    if len(bad):  # errors and non-finite outputs: the worst nights, at a marked ceiling
        text = [html.escape(" ".join(str(row[k]) for k in GROUP)) for _, row in bad.iterrows()]
        nights_bad = [nights[r] for r in bad["run_id"]]
        figure.add_trace(_non_finite_trace(nights_bad, ceiling, text, f"error or non-finite (drawn at {ceiling:.3g})"))
    if figure.data:
        figure.add_hline(y=1.0, line_dash="dash", line_color=FAIL_COLOUR, annotation_text="limit")
    figure.update_yaxes(type="log", title="worst error / limit")
    figure.update_xaxes(title="night", type="category", categoryorder="array", categoryarray=list(nights.values()))
    figure.update_layout(title="Trends per case family (backend, check, family, tensor)")
    return figure


def _of_run(frame: pd.DataFrame, run_id: str) -> pd.DataFrame:
    return frame[frame["run_id"] == run_id] if len(frame) and "run_id" in frame else frame


def night_time(records: pd.DataFrame, nights: pd.DataFrame, quarantines: pd.DataFrame) -> pd.DataFrame:
    """Per backend of one night: the night's wall time (its parts summed), compile seconds, seconds in the
    backend's calls, cases run and skipped (with the commonest reasons), and quarantined configurations."""
    rows = []
    wall = float(nights["wall_seconds"].sum()) if len(nights) else float("nan")
    for backend, part in records[records["backend"] != "(suite)"].groupby("backend"):
        skip = part["verdict"] == "skip"
        ran_cases = set(part.loc[~skip, "case_id"])
        skipped_cases = set(part.loc[skip, "case_id"]) - ran_cases
        reasons = part.loc[skip].drop_duplicates("case_id")["reason"].fillna("").str.slice(0, 90).value_counts()
        compiled = sum(float(by.get(backend, 0.0)) for by in nights["compile_by_backend"]) if len(nights) else 0.0
        mine = quarantines[quarantines["backend"] == backend] if len(quarantines) else quarantines
        if "verdict" in mine:  # the compile stage's cuts are skips (their reason says "not compiled"), not crashes
            mine = mine[mine["verdict"].fillna("error") == "error"]
        quarantined_cases = part["reason"].fillna("").str.startswith("quarantined after")
        rows.append(
            {
                "backend": backend,
                "night wall s": round(wall, 1),
                "compile s": round(compiled, 1),
                "backend s": round(float(part.drop_duplicates(["check", "case_id"])["seconds"].fillna(0).sum()), 1),
                "cases run": len(ran_cases),
                "cases skipped": len(skipped_cases),
                "why skipped (cases)": "; ".join(f"{r} ({n})" for r, n in reasons.head(3).items()),
                "quarantined configs": len(mine),
                "cases not launched (quarantine)": int(part.loc[quarantined_cases, "case_id"].nunique()),
            }
        )
    return pd.DataFrame(rows)


def night_walls(nights: pd.DataFrame, runs: pd.DataFrame) -> go.Figure:
    """Each night's wall time (its parts stacked: shards run on several hosts) and its compile stage."""
    figure = go.Figure()
    labels = night_labels(runs)
    shown = nights[nights["run_id"].isin(labels)] if len(nights) else nights
    for part_name, part in shown.groupby("part") if len(shown) else ():
        x = [labels[r] for r in part["run_id"]]
        name = f"part {part_name}" if part_name else "night"
        figure.add_trace(go.Bar(x=x, y=part["wall_seconds"] / 60, name=f"{name}: wall"))
    if len(shown):
        compile_min = shown.groupby("run_id")["compile_wall_seconds"].sum() / 60
        x = [labels[r] for r in compile_min.index]
        figure.add_trace(go.Scatter(x=x, y=compile_min, mode="lines+markers", name="compile stage (wall, all parts)"))
    figure.update_layout(barmode="stack", title="The night's wall time (minutes)")
    figure.update_xaxes(title="night", type="category", categoryorder="array", categoryarray=list(labels.values()))
    figure.update_yaxes(title="minutes")
    return figure


def coverage_by_backend(records: pd.DataFrame, night: bool = True) -> pd.DataFrame:
    """The required axis values per backend (reports/reach.py): how many it reached, how many lie outside its
    envelope, and the ones the night missed, named (for a run that is not a night: the ones not drawn)."""
    table = backend_coverage(records)
    rows = []
    for backend, part in table.groupby("backend"):
        missed = part[part["status"] == MISSED]
        rows.append(
            {
                "backend": backend,
                "reached": int((part["status"] == "reached").sum()),
                "required": len(part),
                "not supported": ", ".join(
                    f"{a} {v}"
                    for a, v in part[part["status"] == "not supported"][["axis", "value"]].itertuples(index=False)
                ),
                "NOT REACHED" if night else "not drawn": ", ".join(
                    f"{a} {v}" for a, v in missed[["axis", "value"]].itertuples(index=False)
                ),
            }
        )
    return pd.DataFrame(rows)


def sentinel_trends(records: pd.DataFrame, runs: pd.DataFrame) -> go.Figure:
    """Each sentinel's worst error/limit per backend over the runs (1 is the limit)."""
    figure = go.Figure()
    nights = night_labels(runs)
    worst = sentinel_worst(records)
    worst = worst[worst["run_id"].isin(nights)]
    ceiling = _ceiling(worst["worst"])
    worst = worst.assign(worst=worst["worst"].where(worst["worst"].map(math.isfinite).astype(bool), ceiling))
    per_sentinel = worst.groupby(["run_id", "backend", "case_id", "label"], sort=False)["worst"].max().reset_index()
    order = {run_id: i for i, run_id in enumerate(runs["run_id"])}
    for (backend, _, label), part in per_sentinel.groupby(["backend", "case_id", "label"]):
        part = part.assign(night=part["run_id"].map(order)).sort_values("night")
        figure.add_trace(
            go.Scatter(
                x=[nights[r] for r in part["run_id"]],
                y=part["worst"],
                mode="lines+markers",
                name=html.escape(f"{backend} {label}"),
            )
        )
    if figure.data:
        figure.add_hline(y=1.0, line_dash="dash", line_color=FAIL_COLOUR, annotation_text="limit")
        figure.add_hline(y=ceiling, line_dash="dot", line_color="#999", annotation_text="error or non-finite")
    figure.update_yaxes(type="log", title="worst error / limit")
    figure.update_xaxes(title="night", type="category", categoryorder="array", categoryarray=list(nights.values()))
    figure.update_layout(title="Sentinels: the same inputs every night", showlegend=len(figure.data) <= 40)
    return figure


def tier_counts(records: pd.DataFrame) -> pd.DataFrame:
    """Failing and known records per backend and tier (reports/findings.py TIERS), worst tier first."""
    if records.empty or "tier" not in records:
        return pd.DataFrame(columns=["backend", *TIERS])
    tiered = records[records["tier"].fillna("").astype(str) != ""]
    if tiered.empty:
        return pd.DataFrame(columns=["backend", *TIERS])
    counts = pd.crosstab(tiered["backend"], tiered["tier"])
    return counts.reindex(columns=[t for t in TIERS if t in counts.columns]).reset_index()


def observations(records: pd.DataFrame) -> pd.DataFrame:
    """Cases per backend x check x observation (the records' ``observed`` column), with their verdicts."""
    if "observed" not in records:
        return pd.DataFrame()
    seen = records[records["observed"].fillna("") != ""]
    if seen.empty:
        return pd.DataFrame()
    grouped = seen.groupby(["backend", "check", "observed", "verdict"])["case_id"].nunique()
    return grouped.rename("cases").reset_index()


def status_line(last: pd.DataFrame, run: pd.Series, regressions: pd.DataFrame) -> tuple[str, bool]:
    """One sentence on the last complete run, and whether it is green: no failure, no error, no flag but
    "fixed"."""
    counts = last["verdict"].value_counts()
    flags = regressions[regressions["kind"] != "fixed"] if not regressions.empty else regressions
    green = not counts.get("fail", 0) and not counts.get("error", 0) and flags.empty
    verdicts = ", ".join(f"{counts[v]} {v}" for v in VERDICTS if counts.get(v, 0))
    when = run.get("env_date", "")
    text = (
        f"{'Green' if green else 'Red'}: last complete run {run['run_id']} ({when}): {verdicts}; "
        f"{len(flags)} regression flag(s)"
    )
    new = flags[flags["kind"] == "new failure"] if not flags.empty else flags
    if not new.empty:
        first = new.iloc[0]
        text += f"; {len(new)} new failure(s), the first {first['backend']} {first['check']} {first['family']}"
        text += f": {first['repro']}" if first["repro"] else ""
    baselines = set(last["env_baseline"].dropna().astype(str)) - {SUITE_BASELINE} if "env_baseline" in last else set()
    if baselines:
        text += f"; its limits come from a replaced baseline ({', '.join(sorted(baselines))})"
    return text, green


def _apart_line(runs: pd.DataFrame, judged: pd.DataFrame, last_id: str) -> str:
    """The newest run kept apart from the judged ones (a repro line pasted, minimize, triage's reruns), said
    apart so that it is seen without becoming the headline."""
    apart = runs[~runs["run_id"].isin(judged["run_id"]) & (runs["run_id"] != last_id)].tail(1)
    if apart.empty:
        return ""
    row = apart.iloc[0]
    verdicts = ", ".join(f"{row[v]} {v}" for v in VERDICTS if row.get(v, 0))
    return (
        f"<p class='note' id='apart'>Newest run kept apart from the sweeps ({html.escape(str(row['purpose']))}): "
        f"<code>{html.escape(str(row['run_id']))}</code>: {html.escape(verdicts)}.</p>"
    )


def build_dashboard(store: Store, out: Path, window: int = 5, growth: float = 1.5) -> tuple[Path, pd.DataFrame]:
    """Write the dashboard for ``store`` to ``out``; returns the path and the regression table (the last
    complete run against the complete runs before it: runs in progress or cut short are shown, labelled,
    and compared with nothing)."""
    # A debugging run (a repro line pasted, minimize, triage) is a run of its own kind: the headline, the tables
    # and the trends follow the sweeps, and the newest other run is said apart (one repro made the page read
    # "Red: 1 pass, 1 fail" and hid the sweep).
    records, runs, complete = store.records, store.runs, store.judged_runs
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>KDA conformance dashboard</title><style>{STYLE}</style></head><body>",
        "<h1>KDA conformance: tolerance dashboard</h1>",
    ]
    regressions = pd.DataFrame()
    if records.empty:
        parts.append("<p>No runs in the store yet.</p>")
    else:
        # The run shown: the last complete one; where none finished yet, the newest, labelled as such.
        last_id = complete["run_id"].iloc[-1] if not complete.empty else runs["run_id"].iloc[-1]
        last = records[records["run_id"] == last_id]
        compared = complete if not complete.empty else runs[runs["run_id"] == last_id]  # the trends' runs
        which = "last complete run" if not complete.empty else "newest run (not complete)"
        # A night is a run `kda-conformance nightly` made (it writes a night file); a quick `run` is a run.
        night = not _of_run(store.nights, last_id).empty
        history = records[records["run_id"].isin(compared["run_id"])]
        if complete.empty:
            green, status = False, f"No run in the store has finished yet: below, the newest ({last_id}), not compared."
        else:
            regressions = find_regressions(history, complete, window, growth)
            status, green = status_line(last, complete.iloc[-1], regressions)
        unfinished = runs[runs["status"] != COMPLETE]
        after = unfinished[unfinished.index > runs.index[runs["run_id"] == last_id][0]]
        newer = "; ".join(
            f"{r.run_id} ({r.status}, {r.pass_} pass, {r.fail} fail, {r.error} error)"
            for r in after.rename(columns={"pass": "pass_"}).itertuples()
        )
        per_backend = pd.crosstab(last["backend"], last["verdict"]).reset_index()
        env = last.iloc[0][[c for c in last.columns if c.startswith("env_")]]
        # A seed or a count read back as a float (a column with gaps) is shown as the integer it is.
        shown = ["" if pd.isna(v) else str(int(v) if isinstance(v, float) and v.is_integer() else v) for v in env]
        env_table = pd.DataFrame({"": [c.removeprefix("env_") for c in env.index], "value": shown})
        measured = last[last["verdict"].isin(["pass", "fail", "error"])].copy()
        measured["worst"] = record_worst(measured)
        worst = measured.sort_values("worst", ascending=False).head(15)
        columns = ["case_id", "label", "backend", "check", "subject", "tensor", "verdict", "max_abs", "budget", "worst"]
        if "tier" in worst:  # older stores' records have none
            columns.append("tier")
        worst_table = worst[[*columns, "repro"]]
        plots = Plots()
        parts += [
            f"<p id='status' class='{'pass' if green else 'fail'}'>{html.escape(status)}</p>",
            f"<p class='note'>Newer runs, not compared: {html.escape(newer)}</p>" if newer else "",
            _apart_line(runs, complete, last_id),
            "<h2>Overview</h2>",
            f"<p>{html.escape(store.runs_sentence())}; {which} <code>{html.escape(last_id)}</code>.</p>",
            _table(runs, "runs"),
            f"<h3>{which.capitalize()} per backend</h3>",
            _table(per_backend, "per-backend"),
            f"<h3>{which.capitalize()}: environment</h3>",
            _table(env_table, "environment"),
            "<h2>Regressions (last complete run against the complete runs before it)</h2>",
            f"<p class='note'>Worst error/limit per backend, case family and tensor against the median of up to "
            f"{window} earlier complete runs; growth flagged past {growth:g} times the median.</p>",
            _table(regressions, "regressions", code_columns=("repro",)),
            "<h2>History per cell (backend, check, GPU model)</h2>",
            "<p class='note'>Each cell over the judged runs: its status tonight, the nights in a row at it, the "
            "last green night, the flips (flaky at 3 or more over the last 10 nights), and for a red cell the "
            "night its streak began, what changed since it was green and the suite commits to bisect "
            "(kda-conformance history).</p>",
            _table(red_first(cell_history(store)), "history"),
            f"<h2>Failures by tier, {which}</h2>",
            "<p class='note'>Failing and known records per backend and tier: broken (non-finite, a crash, a wrong "
            "shape or dtype, memory written that is not the kernel's), beyond the tolerance the library's own "
            "tests assert, or beyond the suite's working-precision limits only.</p>",
            _table(tier_counts(last), "tiers"),
            f"<h2>Cost of design: declared working precisions, {which}</h2>",
            "<p class='note'>Backends that declare where their kernel computes below the case's precision by a "
            "design their library states (FlashKDA: a bf16 state between 16-token chunks; FLA's chunk kernels and "
            "their copies: TF32 float32 matmuls on NVIDIA) are judged against the baseline at that precision; "
            "this is what the design costs against the strict limits, per input dtype (what a user passing fp32 "
            "gets), apart from the findings. A declaration under which every record passes the strict limits "
            "is unnecessary.</p>",
            _table(precision_costs(last), "precision-costs"),
            "<h2>Known issues that no longer reproduce</h2>",
            "<p class='note'>Ledger entries (conformance/known_issues.toml) that matched cases of the last complete "
            "run, none of which reproduced them: remove them from the ledger.</p>",
            _table(stale_known_issues(last), "stale-known-issues"),
            "<h2>Error against length</h2>",
            plots.html(
                error_vs_length(last), "error-vs-length", "No budget-check record with a measured error in this run."
            ),
            "<h2>Trends</h2>",
            plots.html(trends(nightly_groups(history), compared), "trends", "No measured record to trend.")
            if len(compared) > 1
            else "<p class='note' id='trends'>One run: a trend needs two or more.</p>",
            "<h2>Sentinel trends</h2>",
            "<p class='note'>The sentinels (cases/sentinels.json) run with the same inputs every night: each "
            f"line is one sentinel on one backend; growth past {SENTINEL_GROWTH:g} times its median is flagged "
            "above, within the budget or not.</p>",
            plots.html(
                sentinel_trends(history, compared) if len(compared) > 1 else go.Figure(),
                "sentinel-trends",
                "No sentinel ran in these runs: the sentinels run in the nightly and long profiles "
                "(kda-conformance nightly), not in the ci or smoke profile nor the first sweep.",
            ),
            f"<h2>Worst cases of the {which}</h2>",
            _table(worst_table, "worst", code_columns=("repro",)),
            f"<h2>What the checks observed, {which}</h2>",
            "<p class='note'>Beyond pass and fail: batch invariance, padded tails, metadata patterns, "
            "determinism, known issues (cases per backend, check and observation).</p>",
            _table(observations(last), "observations"),
            f"<h2>The {'night' if night else 'run'}'s time, {which}</h2>",
            "<p class='note'>Per backend: the night's wall time (its parts summed), the compile stage's seconds "
            "(kda-conformance nightly compiles every kernel configuration up front), seconds in the backend's "
            "calls, cases run and skipped, and kernel configurations quarantined after a crash (their later "
            "cases recorded as errors without launching). Runs made without `kda-conformance nightly` have no "
            "night file: their wall and compile columns are empty.</p>",
            _table(
                night_time(
                    last,
                    _of_run(store.nights, last_id),
                    _of_run(store.quarantines, last_id),
                ),
                "night-time",
            ),
            _table(_of_run(store.quarantines, last_id), "quarantines")
            if len(_of_run(store.quarantines, last_id))
            else "",
            plots.html(
                night_walls(store.nights, compared),
                "night-walls",
                "No run here was made by kda-conformance nightly (it writes each night's wall time).",
            ),
            f"<h2>Required values per backend, {which}</h2>",
            "<p class='note'>Every night must reach each value of NIGHT_REQUIRED (cases/coverage.py) on every "
            "backend that supports it: gate forms, dtypes, state dtypes and layouts, default and explicit scale, "
            "head dims, head counts, batches with an initial state, packed zero-length members, chunk and "
            "segment edges, checkpoints on and off chunk boundaries, 128K tokens in each dtype. A value whose "
            "cases a backend only skipped is outside its envelope; NOT REACHED is a hole in the night."
            + (
                ""
                if night
                else " This run is not a night (kda-conformance nightly): the values it did not "
                "draw are listed as not drawn, not as holes."
            )
            + "</p>",
            _table(coverage_by_backend(last, night), "coverage-by-backend"),
            f"<h2>Axis coverage, {which}</h2>",
            "<p class='note'>Distinct cases per value of each axis (cases/coverage.py): the values a run "
            "did not reach are where its bugs could hide.</p>",
            _table(record_coverage(last), "coverage"),
        ]
    if store.problems:
        parts += ["<h2>Files skipped or partly read</h2><ul>"]
        parts += [f"<li>{html.escape(p)}</li>" for p in store.problems] + ["</ul>"]
    parts.append("</body></html>")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_plotly_beside(out)
    atomic_write(out, lambda path: path.write_text("\n".join(parts)))
    return out, regressions


def write_plotly_beside(page: Path) -> Path:
    """Plotly's script (``plotly.min.js``, the version the page was drawn with) in the page's folder, written
    once: the page loads it from there, so a store's pages share one copy, and a page copied elsewhere
    needs the file beside it."""
    script = Path(page).parent / PLOTLY_JS
    code = get_plotlyjs()
    if not script.exists() or script.stat().st_size != len(code.encode()):
        atomic_write(script, lambda path: path.write_text(code))
    return script
