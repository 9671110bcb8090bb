"""The Case type, its stable id and JSON form, seeded inputs, Hypothesis strategies, profiles, the corpus;
the dtype and device helpers every layer shares (the bottom layer: it imports no other package of the suite)."""

from kda_cases.shadowing import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_cases")
