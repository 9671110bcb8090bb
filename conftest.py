"""Wires the suite's pytest plugin (markers, options, device selection) into every run from this checkout."""

pytest_plugins = ("kda_conformance.pytest_plugin",)
