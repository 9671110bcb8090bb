"""Record schema and run files: one row per case x backend x tensor."""

from kda_conformance.layout import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_reports")
