"""Adapters for the implementations under test, behind one small backend protocol; the serving harness."""

from kda_cases.shadowing import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_kernels")
