"""A check that runs at most two examples per backend (``Check.max_examples``), whatever the profile gives the
others, and counts its calls in the file KDA_TEST_CAPPED_COUNT names (tests/test_autotune_configs.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from kda_conformance.checks import get_check, register


def _counted(truth, backend, params, judge):
    path = Path(os.environ["KDA_TEST_CAPPED_COUNT"])
    path.write_text(str(int(path.read_text() or 0) + 1) if path.exists() else "1")
    return [judge.passed("counted")]


register(
    dataclasses.replace(
        get_check("determinism"), name="capped_probe", test_name="test_capped_probe", run=_counted, max_examples=2
    )
)
