from kda_conformance.cli import entry

entry()
