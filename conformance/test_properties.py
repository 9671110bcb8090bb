"""Properties over cases drawn for the chosen profile (--kda-profile), against every selected backend.

One Hypothesis test per check of the ``properties`` suite in the check registry (kda_conformance.checks):
the budget check, split and resume, prefix invariance, packing isolation. A failure prints the drawn case
(Hypothesis), the findings and a repro line that reruns that check on that case.
"""

from __future__ import annotations

import pytest

from kda_conformance.checks._tests import suite_tests

pytestmark = pytest.mark.kda_device_dependent

# The tests are made from the registry: one per check, named as the check says (test_within_budget, ...).
globals().update(suite_tests("properties"))
