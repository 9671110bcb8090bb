"""``python -m kda_conformance.cli``: the command line, as ``kda-conformance`` runs it."""

from kda_conformance.cli import entry

entry()
