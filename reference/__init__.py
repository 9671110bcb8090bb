"""The float64 ground truth: the recurrent KDA token loop and the input preprocessing it shares with every backend."""

from kda_conformance.layout import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_reference")
