"""``kda-conformance``: the suite outside pytest."""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import sys
from pathlib import Path

import pandas as pd
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kda_cases.case import Case
from kda_cases.corpus import CORPUS_DIR, load_corpus, save_case
from kda_cases.profiles import PROFILES, get_profile
from kda_cases.strategies import draw_cases, kernel_pool_lines, with_kernel_pool
from kda_conformance.calibrate import (
    GATE_REGIMES,
    INITIAL_STATES,
    calibration_cases,
    calibration_markdown,
    calibration_table,
)
from kda_conformance.isolation import DEFAULT_CASE_TIMEOUT, run_cases_isolated
from kda_conformance.serving import SERVING_CHECKS
from kda_conformance.stages import CLOCK
from kda_conformance.sweep import (
    FIRST_SWEEP_LENGTHS,
    Outcome,
    first_sweep_cases,
    outcome_records,
    parse_choices,
    parse_dtypes,
    parse_lengths,
    record_line,
    resolve_device,
    run_cases,
)
from kda_conformance.tolerance import failure_message
from kda_kernels import registry
from kda_kernels.protocol import Backend
from kda_kernels.serving import POISON_MODES
from kda_reference.run import FORM_VARIABLE, FORMS
from kda_reports.environment import environment
from kda_reports.runfile import DEFAULT_OUT, RunRecorder, read_run


def _arg(parse):  # type: ignore[no-untyped-def]
    def convert(text: str):  # type: ignore[no-untyped-def]
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kda-conformance", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the conformance sweep and write a report")
    _common_arguments(run, default_dtypes=["bf16", "fp32"])
    run.add_argument(
        "--profile",
        choices=list(PROFILES),
        default=None,
        help="instead of the first sweep: the committed corpus plus cases drawn for this profile",
    )
    run.add_argument("--examples", type=int, default=None, help="cases to draw for --profile (default: the profile's)")
    run.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rebuild OUT/dashboard.html from every run under OUT afterwards (default: on)",
    )
    _regression_arguments(run)
    _isolation_arguments(run)
    _reference_arguments(run)
    corpus = sub.add_parser("corpus", help="list or add pinned cases (cases/corpus)")
    corpus_sub = corpus.add_subparsers(dest="corpus_command", required=True)
    corpus_sub.add_parser("list", help="print the pinned cases")
    add = corpus_sub.add_parser("add", help="pin a case, or every failing case of a run file")
    add.add_argument("--case", type=_arg(parse_case), default=None, metavar="JSON_OR_FILE")
    add.add_argument("--from-run", type=Path, default=None, metavar="RUN_FILE", help="pin the run's failing cases")
    add.add_argument("--why", default="", help="why the case matters (stored with it)")
    add.add_argument("--dir", type=Path, default=CORPUS_DIR, help="corpus folder (default: cases/corpus)")
    run.add_argument(
        "--case",
        action="append",
        dest="cases",
        type=_arg(parse_case),
        metavar="JSON_OR_FILE",
        help="run this case (JSON text or a .json file) instead of the sweep; repeatable; "
        "every failure prints such a command",
    )
    calibrate = sub.add_parser(
        "calibrate", help="measure error/budget ratios over a grid of cases and write the calibration table"
    )
    _common_arguments(calibrate, default_dtypes=["bf16", "fp16", "fp32"])
    calibrate.add_argument(
        "--gate-regimes",
        type=_arg(_choices("gate regimes", GATE_REGIMES)),
        default=list(GATE_REGIMES),
        help="e.g. typical,weak",
    )
    calibrate.add_argument(
        "--initial-states",
        type=_arg(_choices("initial states", INITIAL_STATES)),
        default=list(INITIAL_STATES),
        help="e.g. none,random",
    )
    calibrate.add_argument("--table", type=Path, default=None, help="also write the markdown table to this file")
    calibrate.add_argument(
        "--records",
        type=Path,
        nargs="+",
        default=None,
        metavar="RUN_FILE",
        help="build the table from these run files (.parquet or .records.jsonl) instead of running cases",
    )
    detection = sub.add_parser(
        "detection",
        help="run the properties and the corpus for some backends (say, planted bugs) and tabulate what caught each",
    )
    detection.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE", help="module that registers backends (repeatable)"
    )
    detection.add_argument(
        "--backend",
        action="append",
        dest="backends",
        metavar="NAME",
        help="backend to run, repeatable (default: every backend the plugins register)",
    )
    detection.add_argument(
        "--plugin-backends", action="store_true", help="with --backend: also every backend the plugins register"
    )
    detection.add_argument("--profile", choices=list(PROFILES), default="ci", help="sweep profile (default: ci)")
    detection.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    detection.add_argument("--seed", type=int, default=None, help="seed of a randomized profile")
    detection.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./out)")
    detection.add_argument("--table", type=Path, default=None, help="also write the markdown table to this file")
    dashboard = sub.add_parser("dashboard", help="build the HTML tolerance dashboard from a run store")
    dashboard.add_argument("--store", type=Path, default=DEFAULT_OUT, help="the store: a run folder (default: ./out)")
    dashboard.add_argument("--html", type=Path, default=None, help="where to write it (default: STORE/dashboard.html)")
    _regression_arguments(dashboard)
    nightly = sub.add_parser(
        "nightly", help="the nightly job: the nightly profile into a store, then the dashboard (one command)"
    )
    nightly.add_argument("--store", type=Path, required=True, help="the run store (a folder kept between nights)")
    nightly.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    nightly.add_argument("--plugin", action="append", default=[], metavar="MODULE")
    nightly.add_argument("--backend", action="append", dest="backends", metavar="NAME")
    nightly.add_argument("--profile", choices=list(PROFILES), default="nightly")
    nightly.add_argument("--examples", type=int, default=None, help="cases to draw (default: the profile's)")
    nightly.add_argument("--seed", type=int, default=None)
    nightly.add_argument("-v", "--verbose", action="store_true")
    _isolation_arguments(nightly)
    _regression_arguments(nightly)
    _reference_arguments(nightly)
    repro = sub.add_parser(
        "repro", help="rebuild one case through the serving harness, say where it goes wrong, write a standalone test"
    )
    repro.add_argument(
        "--case", required=True, metavar="JSON_FILE_OR_ID", help="case JSON, a .json file, or a corpus id"
    )
    repro.add_argument("--backend", required=True, metavar="NAME")
    repro.add_argument("--plugin", action="append", default=[], metavar="MODULE", help="module that registers backends")
    repro.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    repro.add_argument(
        "--poison", default="nan", choices=POISON_MODES, help="what fills forbidden memory (default: nan)"
    )
    repro.add_argument(
        "--check", default="poison", choices=list(SERVING_CHECKS), help="which serving check (default: poison)"
    )
    repro.add_argument(
        "--write-test", type=Path, default=None, metavar="FILE", help="also write a standalone pytest file"
    )
    return parser


def _regression_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", type=int, default=5, help="earlier runs a run is compared with (default: 5)")
    parser.add_argument(
        "--growth", type=float, default=1.5, help="flag a worst error/limit grown past this times the median"
    )


def _reference_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reference-form",
        choices=FORMS,
        default=None,
        help="exact form of the float64 truth: auto (default: the chunked form from a few tokens on), "
        "loop (the token-by-token definition) or chunked",
    )


def _isolation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each case in a worker process, so a crash or a hang costs that case only "
        "(default: on for GPUs, off on the CPU)",
    )
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=DEFAULT_CASE_TIMEOUT,
        metavar="S",
        help=f"with --isolate: seconds one case may take on one backend (default: {DEFAULT_CASE_TIMEOUT:g})",
    )


def _common_arguments(parser: argparse.ArgumentParser, default_dtypes: list[str]) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./out)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE, which registers more backends (repeatable)",
    )
    parser.add_argument(
        "--backend",
        action="append",
        dest="backends",
        metavar="NAME",
        help="backend to test, repeatable (default: fla_chunk and fla_recurrent)",
    )
    parser.add_argument("--lengths", type=_arg(parse_lengths), default=None, help="sequence lengths, e.g. 37,64,65,130")
    parser.add_argument(
        "--dtypes",
        type=_arg(parse_dtypes),
        default=default_dtypes,
        help=f"input dtypes (default: {','.join(default_dtypes)})",
    )
    parser.add_argument("--heads", type=int, default=2, help="query/key heads (= value heads) per case")
    parser.add_argument("--head-dim", type=int, default=64, help="K = V head dimension")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-v", "--verbose", action="store_true", help="print each record as it is measured")


def _choices(what: str, allowed: tuple[str, ...]):  # type: ignore[no-untyped-def]
    return lambda text: parse_choices(what, text, allowed)


def parse_case(text: str) -> Case:
    """A case from JSON text or from a file holding it."""
    source = text
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"--case takes case JSON or a .json file; {text!r} is neither")
        source = path.read_text()
    try:
        return Case.from_json(source)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"--case: not a valid case: {exc}") from None


def _summary_table(frame: pd.DataFrame) -> Table:
    table = Table(title="KDA conformance: max-abs error against the float64 reference")
    for col in ("case", "backend", "tensor", "verdict", "max-abs", "budget", "rel-RMS", "s"):
        table.add_column(col, justify="right" if col in ("max-abs", "budget", "rel-RMS", "s") else "left")
    colors = {"pass": "green", "fail": "red", "error": "red", "skip": "yellow"}
    for row in frame.itertuples():

        def fmt(x: float) -> str:
            return "" if pd.isna(x) else f"{x:.2e}"

        verdict = f"[{colors.get(row.verdict, 'white')}]{row.verdict}[/]"
        table.add_row(
            f"{row.case_id}\n{row.label}",
            row.backend,
            row.tensor or "-",
            verdict,
            fmt(getattr(row, "max_abs", float("nan"))),
            fmt(getattr(row, "budget", float("nan"))),
            fmt(getattr(row, "rel_rms", float("nan"))),
            f"{row.seconds:.2f}",
        )
    return table


def _backends(args: argparse.Namespace, console: Console) -> tuple[torch.device, list[Backend]] | None:
    try:
        device = resolve_device(args.device)
        for module in args.plugin:
            registry.load_plugin(module)
        names = args.backends or ["fla_chunk", "fla_recurrent"]
        return device, [registry.get(name) for name in names]
    except (ValueError, KeyError, registry.PluginError) as exc:
        console.print(f"[red]error:[/] {exc.args[0]}")
        return None


def _sweep(
    cases: list[Case], backends: list[Backend], device: torch.device, args: argparse.Namespace, console: Console
) -> tuple[pd.DataFrame, dict[str, Path], list[str]]:
    """Run, show progress (and each record with -v), write the run files; returns the failure messages too.

    Rows reach the run's partial file as they are measured, so even a killed process leaves them.
    """
    env = {**environment(device), "command": args.command_line}
    if getattr(args, "profile", None):
        env["profile"] = args.profile
        seed = getattr(args, "profile_seed", None)
        env["seed"] = "" if seed is None else seed
    recorder = RunRecorder(env, args.out)
    CLOCK.drain()  # the run's timing file holds this run's time only
    rows = recorder.rows
    failures: list[str] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("sweep", total=len(cases) * len(backends))

        def record(outcome: Outcome) -> None:
            new = outcome_records(outcome)
            recorder.add(new)
            if args.verbose:
                for row in new:
                    progress.console.print(record_line(row), highlight=False, soft_wrap=True)
            failures.extend(failure_message(outcome.case, outcome.backend, v, outcome.repro) for v in outcome.failed)
            if outcome.status == "error":
                failures.append(
                    f"{outcome.case.id} ({outcome.case.label}) backend {outcome.backend}: error: {outcome.reason}\n"
                    f"  repro: {outcome.repro}"
                )
            progress.update(task, advance=1, description=f"{outcome.backend} {outcome.case.label}")

        isolate = args.isolate if getattr(args, "isolate", None) is not None else device.type != "cpu"
        try:
            if isolate:
                names = [b.name for b in backends]
                run_cases_isolated(cases, names, device, args.plugin, args.case_timeout, on_outcome=record)
            else:
                run_cases(cases, backends, device, on_outcome=record)
        except KeyboardInterrupt:
            # Ctrl-C or a time limit's SIGTERM: keep what was measured; the environment says it is partial.
            console.print(f"[yellow]interrupted after {len(rows)} records; writing them[/]")
            interrupted = True
        else:
            interrupted = False
    frame, paths = recorder.finish(complete=not interrupted, timing=CLOCK.snapshot())
    if interrupted:
        raise SweepInterrupted(frame, paths, failures)
    return frame, paths, failures


class SweepInterrupted(Exception):
    """The sweep was stopped; its partial run files were written."""

    def __init__(self, frame: pd.DataFrame, paths: dict[str, Path], failures: list[str]) -> None:
        super().__init__("interrupted")
        self.frame, self.paths, self.failures = frame, paths, failures


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    chosen = _backends(args, console)
    if chosen is None:
        return 2
    device, backends = chosen
    if args.reference_form:
        os.environ[FORM_VARIABLE] = args.reference_form  # isolated case processes inherit it
    if args.cases:
        cases = args.cases
    elif args.profile:
        cases = _profile_cases(args, console)
    else:
        cases = first_sweep_cases(
            lengths=args.lengths or FIRST_SWEEP_LENGTHS,
            dtypes=args.dtypes,
            num_heads=args.heads,
            head_dim=args.head_dim,
            seed=args.seed,
        )
    frame, paths, failures = _sweep(cases, backends, device, args, console)
    run_id = frame["run_id"].iloc[0]
    console.print(_summary_table(frame))
    for row in frame[frame["verdict"] == "skip"].itertuples():
        console.print(f"[yellow]skip[/] {row.backend} {row.case_id} ({row.label}): {row.reason}")
    for message in failures:
        console.print(f"[red]FAIL[/] {message}", highlight=False, soft_wrap=True)
    counts = frame["verdict"].value_counts().to_dict()
    console.print(f"run {run_id}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    console.print(f"records: {paths['records']}\nsummary: {paths['summary_md']}")
    console.print("suite time by stage: " + "\n  ".join(CLOCK.lines()), highlight=False)
    if args.dashboard:
        _rebuild_dashboard(args.out, None, args, console)
    return 1 if counts.get("fail") or counts.get("error") else 0


def _profile_cases(args: argparse.Namespace, console: Console) -> list[Case]:
    """The corpus cases the profile admits, then freshly drawn ones (the seed goes into the report)."""
    profile = get_profile(args.profile)
    # One case list serves every backend here, so the interpreted backends' (tighter) corpus limit applies.
    pinned = [e.case for e in load_corpus() if profile.corpus_skip(e.case, interpreted=True) is None]
    seed = None if profile.derandomize else (args.seed or secrets.randbelow(2**31))
    args.profile_seed = seed
    profile = with_kernel_pool(profile, seed)
    for line in kernel_pool_lines(profile):
        console.print(line, highlight=False)
    drawn = draw_cases(profile, args.examples or profile.max_examples, seed)
    how = "derandomized" if seed is None else f"seed {seed} (rerun with --seed {seed})"
    console.print(f"profile {profile.name}: {len(pinned)} corpus cases, {len(drawn)} drawn, {how}")
    return pinned + drawn


def cmd_corpus(args: argparse.Namespace, console: Console) -> int:
    if args.corpus_command == "list":
        for entry in load_corpus():
            console.print(f"{entry.case.id}  {entry.case.label}  [dim]{entry.why}[/]", highlight=False)
        return 0
    if (args.case is None) == (args.from_run is None):
        console.print("[red]error:[/] corpus add takes exactly one of --case and --from-run")
        return 2
    if args.case is not None:
        found = [(args.case, args.why or "added by hand")]
    else:
        try:
            frame = read_run(args.from_run)
        except (OSError, ValueError) as exc:
            console.print(f"[red]error:[/] --from-run: {exc}")
            return 2
        bad = frame[frame["verdict"].isin(["fail", "error"])].drop_duplicates("case_id")
        why = args.why or f"failed in run {frame['run_id'].iloc[0] if len(frame) else '?'}"
        found = [
            (Case.from_json(text), f"{why}: {backend} {tensor or 'raised'}")
            for text, backend, tensor in zip(bad["case_json"], bad["backend"], bad["tensor"], strict=True)
        ]
    for case, why in found:
        path, new = save_case(case, why, args.dir)
        console.print(f"{'added' if new else 'already pinned'}: {path.name} ({case.label})", highlight=False)
    if not found:
        console.print("no failing cases in that run")
    return 0


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    if args.records:
        return _calibration_from_records(args, console)
    chosen = _backends(args, console)
    if chosen is None:
        return 2
    device, backends = chosen
    cases = calibration_cases(
        lengths=args.lengths or FIRST_SWEEP_LENGTHS,
        dtypes=args.dtypes,
        num_heads=args.heads,
        head_dim=args.head_dim,
        gate_regimes=args.gate_regimes,
        initial_states=args.initial_states,
        seed=args.seed,
    )
    frame, paths, failures = _sweep(cases, backends, device, args, console)
    for message in failures:
        console.print(f"[red]FAIL[/] {message}", highlight=False, soft_wrap=True)
    _write_calibration(frame, [args.command_line], args, console)
    console.print(f"records: {paths['records']}")
    return 0


def _calibration_from_records(args: argparse.Namespace, console: Console) -> int:
    try:
        frames = [read_run(path) for path in args.records]
    except (OSError, ValueError) as exc:
        console.print(f"[red]error:[/] --records: {exc}")
        return 2
    frame = pd.concat(frames, ignore_index=True)
    # The table names the commands that produced the runs, as the run files recorded them.
    commands = list(dict.fromkeys(frame["env_command"].dropna())) if "env_command" in frame else []
    _write_calibration(frame, commands or ["(unknown)"], args, console)
    return 0


def _write_calibration(frame: pd.DataFrame, commands: list[str], args: argparse.Namespace, console: Console) -> None:
    table = calibration_table(frame)
    # Runs merged from several files may differ in commit and date: name every value.
    env = {
        k.removeprefix("env_"): ", ".join(str(v) for v in dict.fromkeys(frame[k].dropna()))
        for k in frame.columns
        if k.startswith("env_")
    }
    text = calibration_markdown(table, commands, env)
    console.print(text, highlight=False, soft_wrap=True)
    if args.table is not None:
        args.table.write_text(text)
        console.print(f"table: {args.table}")


def cmd_dashboard(args: argparse.Namespace, console: Console) -> int:
    _rebuild_dashboard(args.store, args.html, args, console)
    return 0


def _rebuild_dashboard(store_dir: Path, html: Path | None, args: argparse.Namespace, console: Console) -> None:
    """The dashboard of every run under ``store_dir``, and the regressions it flags, printed."""
    from kda_reports.dashboard import build_dashboard
    from kda_reports.store import load_store

    store = load_store(store_dir)
    for problem in store.problems:
        console.print(f"[yellow]store:[/] {problem}", highlight=False)
    target = html or Path(store_dir) / "dashboard.html"
    path, regressions = build_dashboard(store, target, args.window, args.growth)
    for row in regressions.itertuples():
        console.print(
            f"[red]{row.kind}[/] {row.backend} {row.family} {row.tensor}: worst {row.tonight:.3g} "
            f"(before {row.before:.3g}); {row.cause}" + (f"\n  repro: {row.repro}" if row.repro else ""),
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"{len(store.runs)} runs, {len(regressions)} flags; dashboard: {path}")


def cmd_nightly(args: argparse.Namespace, console: Console) -> int:
    args.out, args.cases, args.dashboard = args.store, None, True
    return cmd_run(args, console)


def cmd_repro(args: argparse.Namespace, console: Console) -> int:
    from kda_conformance.repro import plan_lines, resolve_case, run_check, write_standalone
    from kda_conformance.serving import serving_case

    try:
        case = resolve_case(args.case)
        args.backends = [args.backend]
        chosen = _backends(args, console)
        if chosen is None:
            return 2
        device, [backend] = chosen
        available = backend.availability(device)
        if not available:
            console.print(f"[red]error:[/] {backend.name} cannot run on {device}: {available.reason}")
            return 2
        served = serving_case(case, backend)
        console.print(
            f"{served.id} ({served.label}) on {backend.name}, {device}, check {args.check}, poison {args.poison}"
        )
        for line in plan_lines(served):
            console.print(line, highlight=False)
        findings = run_check(case, backend, device, args.poison, args.check)
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    for finding in findings:
        console.print(f"[red]FAIL[/] {finding}", highlight=False, soft_wrap=True)
    if not findings:
        console.print("[green]no finding[/]: the served run matches the truth and touches nothing it must not")
    if args.write_test is not None:
        test, data = write_standalone(case, backend, device, args.poison, args.write_test)
        console.print(f"standalone test: {test} (data {data}); run it with: pytest {test}")
    return 1 if findings else 0


def cmd_detection(args: argparse.Namespace, console: Console) -> int:
    from kda_conformance.detection import run_detection, table_markdown

    try:
        before = set(registry.names())
        for module in args.plugin:
            registry.load_plugin(module)
        from_plugins = sorted(set(registry.names()) - before)
        names = [*args.backends, *(from_plugins if args.plugin_backends else [])] if args.backends else from_plugins
        backends = {name: registry.get(name) for name in names}
    except (KeyError, registry.PluginError) as exc:
        console.print(f"[red]error:[/] {exc.args[0]}")
        return 2
    if not names:
        console.print("[red]error:[/] no backends: name them with --backend, or load a plugin that registers some")
        return 2
    console.print(f"detection: {len(names)} backends, profile {args.profile}, device {args.device}")
    run = run_detection(names, args.plugin, args.out, args.profile, args.device, args.seed)
    markdown = table_markdown(run, {n: b.description for n, b in backends.items()}, args.command_line)
    console.print(markdown, markup=False, highlight=False, soft_wrap=True)
    if args.table is not None:
        args.table.write_text(markdown)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = "kda-conformance " + " ".join(shlex.quote(a) for a in _without_table(argv))
    console = Console()
    # A time limit's SIGTERM stops the sweep like Ctrl-C does, so the records so far are kept.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        commands = {
            "run": cmd_run,
            "calibrate": cmd_calibrate,
            "corpus": cmd_corpus,
            "detection": cmd_detection,
            "repro": cmd_repro,
            "dashboard": cmd_dashboard,
            "nightly": cmd_nightly,
        }
        return commands[args.command](args, console)
    except SweepInterrupted as stop:
        console.print(f"partial records: {stop.paths['records']}")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _without_table(argv: list[str]) -> list[str]:
    # The table names the command that produced it; where it was written is not part of that.
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--table", "--out"):
            skip = True
        elif not arg.startswith(("--table=", "--out=")):
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
