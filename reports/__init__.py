"""Findings, the record schema, run files, the run store, regression detection and the dashboard: data in, files out."""

from kda_cases.shadowing import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_reports")
