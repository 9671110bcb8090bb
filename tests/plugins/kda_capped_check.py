"""Probe checks of how the suite's pytest tests draw (tests/test_autotune_configs.py): one that runs at most two
examples per backend (``Check.max_examples``), whatever the profile gives the others, counting its calls in the
file KDA_TEST_CAPPED_COUNT names; one that applies to some draws only; one that applies to none; and one that
writes the ids of the cases it was given."""

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


def _picky(truth, backend, params, judge):
    """Applies to cases of an even number of tokens only, counting the ones it ran on."""
    from kda_conformance.running.blame import NotApplicable

    if truth.case.total_tokens % 2:
        raise NotApplicable("an odd number of tokens")
    return _counted(truth, backend, params, judge)


def _never(truth, backend, params, judge):
    from kda_conformance.running.blame import NotApplicable

    raise NotApplicable("this device cannot hold it")


# A check that does not apply to some draws (another is drawn) and one that applies to none (the test skips).
register(
    dataclasses.replace(
        get_check("determinism"), name="picky_probe", test_name="test_picky_probe", run=_picky, max_examples=2
    )
)
register(
    dataclasses.replace(
        get_check("determinism"), name="never_probe", test_name="test_never_probe", run=_never, max_examples=1
    )
)


def _drawn(truth, backend, params, judge):
    """Appends the drawn case's id to the file KDA_TEST_DRAWN names."""
    with open(os.environ["KDA_TEST_DRAWN"], "a") as drawn:
        drawn.write(truth.case.id + "\n")
    return [judge.passed("drawn")]


# A check that says which cases it was given: one seed must give the same ones in every run.
register(
    dataclasses.replace(
        get_check("determinism"), name="drawn_probe", test_name="test_drawn_probe", run=_drawn, max_examples=3
    )
)
