"""Everything a backend plugin needs, in one place: ``from kda_kernels.api import Backend, Envelope, register``.

The names here are the suite's public face for plugin authors (docs/plugins.md); the modules they come from
are its inside and may move. A test holds ``__all__`` to this list.
"""

from __future__ import annotations

from kda_cases.case import Case
from kda_cases.dtypes import stored
from kda_cases.envelope import Envelope
from kda_cases.materialize import KDAInputs
from kda_kernels.backward import autograd_backward
from kda_kernels.protocol import (
    Backend,
    BackendOutput,
    Library,
    LibraryTolerance,
    Support,
    Unsupported,
    WorkingPrecision,
    relayout,
)
from kda_kernels.registry import register
from kda_reference.gradients import Gradients

__all__ = [
    "Backend",
    "BackendOutput",
    "Case",
    "Envelope",
    "Gradients",
    "KDAInputs",
    "Library",
    "LibraryTolerance",
    "Support",
    "Unsupported",
    "WorkingPrecision",
    "autograd_backward",
    "register",
    "relayout",
    "stored",
]
