"""The checks, in one registry: the budget check, the metamorphic properties and the serving checks.

Each check is one module defining one :class:`Check` (how it draws a case and its parameters, such as a
split point, for a backend; how it runs on a case's truth, returning findings) and one registration
below. The pytest tests (``conformance/test_properties.py``, ``test_serving.py``), ``kda-conformance
detection``, ``kda-conformance repro`` and ``docs/checks.md`` all read this registry (docs/architecture.md).
"""

from kda_conformance.checking.registry import CHECKS, Check, Drawn, Param, get_check, register, run_check
from kda_conformance.checks import (
    budget,
    checkpoint,
    cu_seqlens,
    determinism,
    host_metadata,
    host_syncs,
    packing,
    padded_tail,
    poison,
    prefix,
    split_resume,
    steps,
)

# The registrations, in the order every table shows the checks.
for module in (
    budget,
    split_resume,
    prefix,
    packing,
    determinism,
    poison,
    steps,
    checkpoint,
    cu_seqlens,
    host_metadata,
    host_syncs,
    padded_tail,
):
    register(module.CHECK)

__all__ = ["CHECKS", "Check", "Drawn", "Param", "get_check", "run_check"]
