"""The checks, in one registry: the budget check, the metamorphic properties and the serving checks.

Each check is one module defining one :class:`Check` (how it draws a case and its parameters, such as a
split point, for a backend; how it runs on a case's truth, returning findings) and one registration
below. The pytest tests (``conformance/test_properties.py``, ``test_serving.py``, made by ``_tests.py``),
``kda-conformance detection``, ``kda-conformance repro`` and ``docs/checks.md`` all read this registry
(docs/architecture.md). Everything a check is made of lives here: what a check is (``_check.py``), the
registry (``_registry.py``), inputs derived from a case's (``_derived.py``), a backend run through the
serving harness (``_served.py``) and the pytest tests made from the registry (``_tests.py``); outside this
package a check is imported from it (``from kda_conformance.checks import Check``).
"""

__all__ = ["CHECKS", "Check", "Drawn", "Param", "get_check", "register", "run_check", "serving_case"]

from kda_conformance.checks import (
    autotune_configs,
    budget,
    checkpoint,
    cu_seqlens,
    determinism,
    gradients,
    graph_replay,
    host_metadata,
    host_syncs,
    offsets_past_2_31,
    packing,
    padded_tail,
    poison,
    prefix,
    split_resume,
    steps,
)
from kda_conformance.checks._check import Check, Param
from kda_conformance.checks._registry import CHECKS, get_check, register, run_check
from kda_conformance.checks._served import serving_case
from kda_conformance.running.runnable import Drawn  # what a check draws: the executor (running/) reads it too

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
    autotune_configs,
    offsets_past_2_31,
    graph_replay,
    padded_tail,
    gradients,
):
    register(module.CHECK)
