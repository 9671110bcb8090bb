"""Every selected backend served the way a server runs it (kda_kernels.serving), on cases drawn for the profile.

One Hypothesis test per check of the ``serving`` suite in the check registry (kda_conformance.checks):
poisoned pool slots, output rows and scratch memory must not change the answer and slots nobody names
and rows past the tokens must stay untouched; a two-step prefill, a request resumed from a checkpoint
slot and a reused ``cu_seqlens`` tensor must give the right answer. A failure says where, and prints the
``kda-conformance repro`` line that reruns it.
"""

from __future__ import annotations

import pytest

from kda_conformance.checks._tests import suite_tests

pytestmark = pytest.mark.kda_device_dependent

# The tests are made from the registry: one per check, named as the check says.
globals().update(suite_tests("serving"))
