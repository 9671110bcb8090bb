"""The one builder of repro lines: the shell command that reruns a check on one case, backend and device.

The budget check reruns through ``kda-conformance run --case``; every other check through
``kda-conformance repro --check NAME`` with the parameters it drew (a split point, a poison mode), so the
line reruns the check that failed, not only the budget.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

import torch

from kda_cases.case import Case
from kda_kernels import registry

BUDGET_CHECK = "budget"


def repro_line(
    check: str, case: Case, backend: str, device: torch.device | str, params: Mapping[str, object] | None = None
) -> str:
    """One shell line that reruns ``check`` on exactly this case, backend and device type."""
    device_type = torch.device(device).type
    command = "run" if check == BUDGET_CHECK else "repro"
    head = f"kda-conformance {command} --device {device_type}"
    # The plugins that registered the backend and the baseline its limits derive from: without them the
    # pasted line would not find the backend (or would judge it against the built-in baseline).
    # Each by what finds it again from any directory (a file's path where it is no installed module).
    modules = (registry.plugin_of(backend), registry.plugin_of(registry.BASELINE))
    plugins = dict.fromkeys(registry.plugin_argument(module) for module in modules if module)
    head += "".join(f" --plugin {shlex.quote(plugin)}" for plugin in plugins)
    head += f" --backend {shlex.quote(backend)}"
    if check != BUDGET_CHECK:
        head += "".join(f" --{name} {shlex.quote(str(value))}" for name, value in (params or {}).items())
        head += f" --check {check}"
    return f"{head} --case {shlex.quote(case.to_json())}"
