"""The exact forms of the reference a run may ask for, and the variable that asks (kda_reference/run.py
chooses between them). Apart from the forms themselves, so that the options that name them import no torch."""

from __future__ import annotations

import os

FORMS = ("auto", "loop", "chunked")
# Sets the form for a whole process and its workers (pytest --kda-reference-form, kda-conformance --reference-form).
FORM_VARIABLE = "KDA_REFERENCE_FORM"


def default_form() -> str:
    """The form ``auto`` stands for in this process: ``KDA_REFERENCE_FORM`` when set, else ``auto``."""
    form = os.environ.get(FORM_VARIABLE, "auto") or "auto"
    if form not in FORMS:
        raise ValueError(f"{FORM_VARIABLE}={form!r} is not allowed; choose from {', '.join(FORMS)}")
    return form
