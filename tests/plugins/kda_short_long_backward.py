"""The smoke profile with long backward cases at CPU sizes (two fp32 halves of 24 tokens), for the test of
conformance/test_corpus.py::test_long_backward (tests/test_gradients.py)."""

from __future__ import annotations

import dataclasses

from kda_cases import profiles

profiles.PROFILES["smoke"] = dataclasses.replace(
    profiles.PROFILES["smoke"], long_backward_dtypes=("fp32",), long_backward_tokens=48
)
