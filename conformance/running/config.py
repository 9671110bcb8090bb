"""One run's configuration, shared by the command line and the pytest plugin.

Both front ends turn their options into a :class:`RunConfig` through :func:`build_config`, which checks
every value (an error names the option and the allowed values), loads plugins, picks the profile and the
seed, and draws the run's kernel configurations. Whatever a run does afterwards reads this object.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kda_cases.case import Case, did_you_mean
from kda_cases.corpus import load_corpus
from kda_cases.devices import resolve_device
from kda_cases.files import unwritable
from kda_cases.grids import (
    FIRST_SWEEP_DTYPES,
    FIRST_SWEEP_LENGTHS,
    first_sweep_cases,
    long_backward_cases,
    long_cases,
)
from kda_cases.guarantee import guaranteed_cases
from kda_cases.kernel_configs import KernelConfig, distinct_configs
from kda_cases.profiles import Profile, get_profile
from kda_cases.sentinels import load_sentinels
from kda_cases.strategies import kernel_pool_lines, with_kernel_pool
from kda_conformance.judging.known import LEDGER_VARIABLE, ledger_problem
from kda_conformance.running import shards
from kda_conformance.running.option_values import (
    PROFILE_VARIABLE,
    RUN_ID_VARIABLE,
    SHARD_VARIABLE,
    STRICT_VARIABLE,
    ConfigError,
    parse_shard,
)
from kda_conformance.running.truth import BASELINE
from kda_kernels import registry
from kda_reference.forms import FORM_VARIABLE, FORMS
from kda_reports.environment import SUITE_BASELINE, environment, redact
from kda_reports.findings import MARGIN_REDRAWS, Finding
from kda_reports.runfile import DEFAULT_OUT, claim_run, new_run_id, run_file, run_files, run_stem

RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Grid:
    """The first sweep's fixed grid: lengths x dtypes x (no initial state, random), plus one packed batch."""

    lengths: tuple[int, ...] = FIRST_SWEEP_LENGTHS
    dtypes: tuple[str, ...] = FIRST_SWEEP_DTYPES
    heads: int = 2
    head_dim: int = 64
    seed: int = 0

    def cases(self) -> list[Case]:
        return first_sweep_cases(self.lengths, self.dtypes, self.heads, self.head_dim, self.seed)


@dataclass(frozen=True)
class RunConfig:
    """Everything that decides what a run runs and where its report goes."""

    device: torch.device
    backends: tuple[str, ...]
    profile: Profile | None = None  # the profile of generated cases, its kernel pool drawn for the seed
    seed: int | None = None  # a randomized profile's seed; None when derandomized (or no profile)
    grid: Grid = field(default_factory=Grid)
    out: Path = DEFAULT_OUT
    plugins: tuple[str, ...] = ()
    strict: bool = False  # a selected backend that cannot run fails instead of skipping; so does a warning
    batch_invariant: bool = False  # the backends promise batch invariance: "not batch-invariant" fails
    # Fresh draws that confirm a failure within MARGIN of its limits before it counts (0: none, it counts).
    redraws: int = MARGIN_REDRAWS
    reference_form: str | None = None
    isolate: bool = False  # each case in a worker process (a crash or a hang costs that case only)
    # Seconds one check of one case may take; past it the case is recorded as hung and the process ends
    # (None: no limit). With ``isolate``, the limit of each case's worker process instead.
    case_timeout: float | None = None
    command: str = ""  # the command line, as the run's environment records it
    purpose: str = ""  # what made the run (kda_reports.store: SWEEP_PURPOSES, OTHER_PURPOSES); '' not said
    # One invocation is one run, whatever the number of processes and hosts: the controlling process (or
    # the CI job, through KDA_RUN_ID) names it, and every worker and shard writes a part of it.
    run_id: str = field(default_factory=new_run_id)
    shard: tuple[int, int] | None = None  # (I, N): this host runs the I-th of N shares of the tests

    def fails(self, finding: Finding) -> bool:
        """Whether ``finding`` fails this run: a failure or an error always; a warning under strict mode, or
        a "not batch-invariant" one where the backends promise batch invariance."""
        if finding.failed:
            return True
        if finding.verdict != "warn":
            return False
        return self.strict or (self.batch_invariant and finding.observed == "not batch-invariant")

    @property
    def part(self) -> str | None:
        """The run part this process writes when the run is split over hosts (``s2of4``), else None."""
        return None if self.shard is None else f"s{self.shard[0]}of{self.shard[1]}"

    def shard_plan(self, nodeids: Sequence[str]) -> shards.Plan:
        """How the night's tests (``nodeids``, as every host collects them) are shared among its hosts:
        whole backends to a shard, balanced by this GPU model's measured costs (running/shards.py), so
        every host agrees without talking to the others and a shard compiles its own backends only."""
        count = self.shard[1] if self.shard is not None else 1
        return shards.plan(nodeids, count, self.shard_costs())

    def shard_costs(self) -> shards.Costs:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        return shards.costs_for(name)

    def output_problem(self, claim: bool = True) -> str | None:
        """Why this run cannot write its files (the folder cannot be written or is full, or a run of this id
        is there already, or being written: a run is never overwritten), or None. Asked before the first
        case; ``claim``: take the run id for this process (see :func:`claim_run`), else only look."""
        why = unwritable(Path(self.out) / "runs")
        if why:
            return why
        if claim:
            why = claim_run(Path(self.out), run_stem(self.run_id, self.part))
            if why:
                return f"a run with id {self.run_id} {why}: give another run id"
        # The night's quarantine list may be there already: its compile stage writes it before the cases.
        quarantine = run_file(self.out, self.run_id, self.part, "quarantine")
        taken = [p for p in run_files(self.out, self.run_id, self.part) if p != quarantine]
        if taken:
            return (
                f"a run with id {self.run_id} is already in {self.out} ({taken[0].name}): give another run id "
                "(the shards of one night share one id, each with its own shard)"
            )
        return None

    def export(self) -> None:
        """Set what worker processes (pytest-xdist, isolated cases) must inherit through the environment."""
        if self.reference_form:
            os.environ[FORM_VARIABLE] = self.reference_form

    def environment(self) -> dict:
        """The environment record of the run: machine, libraries, command, and the profile and seed."""
        env = {
            **environment(self.device, self.libraries()),
            "command": redact(self.command),
            "purpose": self.purpose,
            "baseline": baseline_class(),
        }
        if self.profile is not None:
            env["profile"] = self.profile.name
            env["seed"] = "" if self.seed is None else self.seed
        else:  # the first sweep's cases come from the grid's seed
            env["seed"] = self.grid.seed
        if self.shard is not None:
            env["shard"] = f"{self.shard[0]}/{self.shard[1]}"
        return env

    def libraries(self) -> dict[str, tuple[str, str]]:
        """The libraries of the run's backends, as each declares them: ``{name: (distribution, variable)}``."""
        return {
            library.name: (library.distribution, library.source_variable)
            for name in self.backends
            for library in registry.get(name).libraries
        }

    def long_cases(self) -> list[Case]:
        """The run's long cases (the profile's ``long_dtypes``), drawn from its seed."""
        if self.profile is None or not self.profile.long_dtypes:
            return []
        return long_cases(self.profile.long_dtypes, self.profile.long_tokens, self.seed)

    def long_backward_cases(self) -> list[Case]:
        """The run's long backward cases (the profile's ``long_backward_dtypes``), drawn from its seed."""
        if self.profile is None or not self.profile.long_backward_dtypes:
            return []
        return long_backward_cases(self.profile.long_backward_dtypes, self.profile.long_backward_tokens, self.seed)

    def sentinel_cases(self) -> list[Case]:
        """The sentinels (cases/sentinels.json) where the profile runs them."""
        return load_sentinels() if self.profile is not None and self.profile.sentinels else []

    def guaranteed_cases(self) -> list[Case]:
        """The night's guaranteed cases (cases/guarantee.py) where the profile runs them, drawn from its seed."""
        return guaranteed_cases(self.seed) if self.profile is not None and self.profile.guaranteed else []

    def planned_cases(self) -> dict[str, list[Case]]:
        """The cases the run knows before it starts, by kind (its drawn cases take their kernel
        configurations from the guaranteed ones where the profile has them)."""
        profile = self.profile
        corpus = [e.case for e in load_corpus() if not profile.corpus_skip(e.case, False)] if profile else []
        return {
            "guaranteed": self.guaranteed_cases(),
            "corpus": corpus,
            "sentinels": self.sentinel_cases(),
            "long": self.long_cases(),
            "long backward": self.long_backward_cases(),
        }

    def kernel_configs(self, planned: Sequence[Case] | None = None) -> dict[KernelConfig, Case]:
        """The distinct kernel configurations of the planned cases (``planned``, where the caller holds them
        already; they hold the drawn cases' pool), each with its first case: what the night compiles up front."""
        if planned is None:
            planned = [case for cases in self.planned_cases().values() for case in cases]
        return distinct_configs(planned)

    def kernel_config_lines(self) -> list[str]:
        """How many kernel configurations the run plans, by kind, against its profile's bound."""
        if self.profile is None or not self.profile.kernel_configs:
            return []
        kinds = self.planned_cases()
        counts = ", ".join(f"{kind} {len(distinct_configs(cases))}" for kind, cases in kinds.items() if cases)
        total = len(self.kernel_configs([case for cases in kinds.values() for case in cases]))
        return [f"kernel configurations: {total} distinct ({counts}; at most {self.profile.max_kernel_configs})"]

    def kernel_pool_lines(self) -> list[str]:
        return [] if self.profile is None else kernel_pool_lines(self.profile) + self.kernel_config_lines()


def baseline_class() -> str:
    """``module.Class`` of the backend registered as the baseline every limit derives from."""
    baseline = type(registry.get(BASELINE))
    return f"{baseline.__module__}.{baseline.__qualname__}"


def baseline_warning() -> str | None:
    """What to say when a plugin replaced the suite's baseline (every limit moves with it), else None."""
    used = baseline_class()
    if used == SUITE_BASELINE:
        return None
    return f"the baseline {BASELINE} is {used}, not the suite's {SUITE_BASELINE}: every limit of this run follows it"


def default_profile_name(device: torch.device) -> str:
    """``KDA_PROFILE``, else ``ci`` on a CPU and ``nightly`` on a GPU."""
    return os.environ.get(PROFILE_VARIABLE) or ("ci" if device.type == "cpu" else "nightly")


def strict_from_environment() -> bool:
    return os.environ.get(STRICT_VARIABLE, "") not in ("", "0")


def build_config(
    *,
    device: str = "auto",
    backends: Sequence[str] | None = None,
    default_backends: Sequence[str] | None = None,
    plugins: Sequence[str] = (),
    profile: str | None = None,
    default_profile: bool = False,
    examples: int | None = None,
    seed: int | None = None,
    grid: Grid | None = None,
    out: Path | str = DEFAULT_OUT,
    strict: bool | None = None,
    batch_invariant: bool = False,
    redraws: int | None = None,
    reference_form: str | None = None,
    isolate: bool | None = None,
    case_timeout: float | None = None,
    command: str = "",
    purpose: str = "",
    run_id: str | None = None,
    shard: str | None = None,
) -> RunConfig:
    """Check every option and make the run's configuration. ``backends`` None takes ``default_backends``
    (None: every registered backend); ``profile`` None with ``default_profile`` takes the device's default
    profile; a randomized profile without ``seed`` gets a fresh one."""
    try:
        resolved = resolve_device(device)
    except ValueError as exc:
        raise ConfigError("device", str(exc)) from None
    for module in plugins:
        try:
            registry.load_plugin(module)
        except registry.PluginError as exc:
            raise ConfigError("plugin", str(exc)) from None
    known = registry.names()
    chosen = tuple(backends or default_backends or known)
    unknown = [name for name in chosen if name not in known]
    if unknown:
        hints = "".join(did_you_mean(name, known) for name in unknown)
        raise ConfigError("backend", f"{unknown} unknown{hints}; known backends: {', '.join(known)}")
    run_id = run_id or os.environ.get(RUN_ID_VARIABLE) or new_run_id()
    if not RUN_ID.match(run_id):
        raise ConfigError("run-id", f"{run_id!r} must be 1 to 64 letters, digits, '_' or '-'")
    shard = shard or os.environ.get(SHARD_VARIABLE) or None
    try:
        shard_of = parse_shard(shard) if shard else None
    except ValueError as exc:
        raise ConfigError("shard", str(exc)) from None
    if seed is None and shard_of is not None:
        # The shards of one run, on their own hosts, draw from one seed: the run id's.
        seed = int(hashlib.sha256(run_id.encode()).hexdigest(), 16) % 2**31
    chosen_profile = None
    run_seed = None
    if profile is None and default_profile:
        profile = default_profile_name(resolved)
    if profile is not None:
        try:
            chosen_profile = get_profile(profile)
        except ValueError as exc:
            raise ConfigError("profile", str(exc)) from None
        if examples is not None:
            if examples < 1:
                raise ConfigError("examples", f"{examples} must be a positive number of cases")
            chosen_profile = dataclasses.replace(chosen_profile, max_examples=examples)
        if not chosen_profile.derandomize:
            run_seed = seed if seed is not None else secrets.randbelow(2**31)
        chosen_profile = with_kernel_pool(chosen_profile, run_seed)
    if reference_form is not None and reference_form not in FORMS:
        raise ConfigError("reference-form", f"{reference_form!r} not allowed; choose from {', '.join(FORMS)}")
    if redraws is not None and redraws < 0:
        raise ConfigError("redraws", f"{redraws} must be 0 or a positive number of draws")
    if case_timeout is not None and case_timeout <= 0:
        raise ConfigError("case-timeout", f"{case_timeout} must be a positive number of seconds")
    ledger_wrong = ledger_problem()
    if ledger_wrong:
        raise ConfigError(LEDGER_VARIABLE, ledger_wrong)
    return RunConfig(
        device=resolved,
        backends=chosen,
        profile=chosen_profile,
        seed=run_seed,
        grid=grid or Grid(),
        out=Path(out),
        plugins=tuple(plugins),
        strict=strict_from_environment() if strict is None else strict,
        batch_invariant=batch_invariant,
        redraws=MARGIN_REDRAWS if redraws is None else redraws,
        reference_form=reference_form,
        isolate=resolved.type != "cpu" if isolate is None else isolate,
        case_timeout=case_timeout,
        command=command,
        purpose=purpose,
        run_id=run_id,
        shard=shard_of,
    )
