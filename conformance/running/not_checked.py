"""A case that did not run for want of memory (a ``resource`` verdict) is "not checked", never a pass.

Kept apart from the run's configuration (config.py) because every command's exit code reads it, and a command
that runs no kernel (``ledger``, ``findings``, ``--help``) should not import torch to learn a number.
"""

from __future__ import annotations

import os

# Unless this is 1: then a resource verdict counts as a skip.
ACCEPT_RESOURCE_VARIABLE = "KDA_ACCEPT_RESOURCE"
NOT_CHECKED_EXIT = 4  # the exit code that says "not checked", in kda-conformance and pytest alike


def accepts_resource() -> bool:
    return os.environ.get(ACCEPT_RESOURCE_VARIABLE) == "1"
