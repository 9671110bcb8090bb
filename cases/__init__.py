"""The Case type, its stable id and JSON form, and seeded materialization of inputs."""

from kda_conformance.layout import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_cases")
