"""The float64 ground truth: the recurrent KDA token loop (the definition), its exact chunked form,
and the preprocessing every backend shares."""

from kda_cases.shadowing import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_reference")
