"""What a check is: :class:`Check` (how it draws a case and its parameters for a backend, how it runs on the
case's truth) and :class:`Param` (a parameter it draws besides its case). Every check of ``checks/`` is one
such record, registered in ``checks/__init__.py``; ``running/`` sees a check only as the small protocol it
runs (``running/runnable.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.profiles import Profile
from kda_conformance.judging.judge import Judge
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding


@dataclass(frozen=True)
class Param:
    """A parameter a check draws besides its case (a split point, a poison mode). Its name is also the
    option of ``kda-conformance repro`` that sets it (``--at 17``), so a repro line can rerun the check."""

    name: str
    parse: Callable[[str], object]
    help: str
    choices: tuple[str, ...] | None = None


def unchanged(case: Case, backend: Backend) -> Case:
    return case


def applies_to_every_backend(backend: Backend) -> str | None:
    return None


@dataclass(frozen=True)
class Check:
    """One check. ``prepare`` turns a drawn (or a given) case into the case the check runs on (packed for
    the serving checks, say); it must leave such a case unchanged. ``draw`` draws the case and the
    parameters inside a Hypothesis test, rejecting (``assume``) what the backend does not take; ``run``
    checks the backend on a case's truth with those parameters and the judge the executor made for the
    call. Every field is data or a module-level function, so a check travels to an isolated worker process
    as itself (pickled), not as a name."""

    name: str  # what findings, ``repro --check`` and the run's example log call it
    title: str  # how tables show it
    suite: str  # the pytest module its test lives in: "properties" or "serving"
    test_name: str  # its pytest test function
    summary: str
    draw: Callable[[st.DataObject, Profile, Backend], Drawn]
    run: Callable[[CaseTruth, Backend, Mapping[str, object], Judge], list[Finding]]
    # The seed its cases are drawn from in derandomized profiles (ci, smoke): fixed, so that changing the
    # check's code does not change the cases CI draws. Each is the digest Hypothesis derived from the
    # check's test function before the checks moved into this registry, which kept the ci cases and the
    # detection table as they were.
    ci_seed: int
    prepare: Callable[[Case, Backend], Case] = unchanged
    params: tuple[Param, ...] = ()
    targets: bool = False  # in a targeted profile, its error/limit ratios steer Hypothesis toward the worst cases
    requires: Callable[[Backend], str | None] = applies_to_every_backend  # why it cannot apply to a backend
    devices: tuple[str, ...] = ("cpu", "cuda")  # the device types it applies to
    # At most this many examples per backend, whatever the profile gives the others (None: the profile's): a
    # check whose one example is many calls (every autotune configuration of every kernel) costs a night
    # what a dozen of the others do.
    max_examples: int | None = None

    def applies(self, backend: Backend, device_type: str) -> str | None:
        """Why the check does not apply to ``backend`` on a device of this type (None: it applies)."""
        if device_type not in self.devices:
            return f"check {self.name} runs on {' and '.join(self.devices)} only, not {device_type}"
        return self.requires(backend)
