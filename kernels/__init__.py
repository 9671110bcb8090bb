"""Adapters for the implementations under test, behind one small backend protocol."""

from kda_conformance.layout import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_kernels")
