"""The pytest plugin: options, the device under test, and device markers on conformance tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs, materialize
from kda_conformance.sweep import resolve_device
from kda_kernels import registry, triton_interpret
from kda_reference.recurrent import ReferenceResult
from kda_reference.run import run_reference


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kda", "KDA conformance")
    group.addoption("--kda-device", default="auto", help="device under test: auto (default), cpu, cuda, cuda:N")
    group.addoption(
        "--kda-backend",
        action="append",
        default=None,
        metavar="NAME",
        help="backend to test (repeatable); default: every registered backend",
    )


def selected_backends(config: pytest.Config) -> list[str]:
    chosen = config.getoption("--kda-backend")
    known = registry.names()
    if chosen:
        unknown = [name for name in chosen if name not in known]
        if unknown:
            raise pytest.UsageError(f"--kda-backend {unknown} unknown; known backends: {', '.join(known)}")
        return chosen
    return known


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kda_backend_name" in metafunc.fixturenames:
        metafunc.parametrize("kda_backend_name", selected_backends(metafunc.config))


@pytest.fixture(scope="session")
def kda_device(request: pytest.FixtureRequest) -> torch.device:
    return resolve_device(request.config.getoption("--kda-device"))


@pytest.fixture(scope="session")
def kda_truth() -> Callable[[Case, torch.device], tuple[KDAInputs, ReferenceResult]]:
    """Inputs and float64 truth per case, computed once per session."""
    cache: dict[tuple[str, str], tuple[KDAInputs, ReferenceResult]] = {}

    def get(case: Case, device: torch.device) -> tuple[KDAInputs, ReferenceResult]:
        key = (case.id, str(device))
        if key not in cache:
            inputs = materialize(case, device)
            cache[key] = (inputs, run_reference(inputs))
        return cache[key]

    return get


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Conformance tests run on the chosen device: mark them so `-m cpu` / `-m cuda` select them.
    device = resolve_device(config.getoption("--kda-device"))
    marker = "cpu" if device.type == "cpu" else ("rocm" if torch.version.hip else "cuda")
    for item in items:
        if item.get_closest_marker("kda_device_dependent"):
            item.add_marker(getattr(pytest.mark, marker))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kda_device_dependent: runs on the device chosen by --kda-device")
    # On a CPU the FLA kernels run in Triton's interpreter, which must be switched on
    # before anything imports triton or fla (test modules included).
    if resolve_device(config.getoption("--kda-device")).type == "cpu" and not triton_interpret.problem():
        triton_interpret.enable()
