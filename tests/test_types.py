"""The type checker over the suite, as it is installed (``kda_cases`` is ``cases/``, ...): mypy with the
configuration in pyproject.toml, strict for kda_cases and kda_reference; the modules listed there as
exceptions still have errors, and a listed module that has none must leave the list (it only shrinks)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
CONFIG = tomllib.loads(PYPROJECT.read_text())
PACKAGES: dict[str, str] = CONFIG["tool"]["setuptools"]["package-dir"]  # import name -> folder
EXCEPTIONS = next(o["module"] for o in CONFIG["tool"]["mypy"]["overrides"] if o.get("ignore_errors"))


def _mypy(folder: Path, config: Path) -> tuple[str, int]:
    """mypy over every package seen under its import name (a folder of links: mypy does not run the
    editable install's import hook), with ``config`` and the cache in the repo."""
    folder.mkdir()
    for name, source in PACKAGES.items():
        (folder / name).symlink_to(ROOT / source, target_is_directory=True)
    # A cache per configuration: this one shows the exceptions' errors, a developer's own mypy run hides them.
    argv = ["--config-file", str(config), "--cache-dir", str(ROOT / ".mypy_cache" / config.stem)]
    for name in PACKAGES:
        argv += ["-p", name]
    here = Path.cwd()
    os.chdir(folder)  # mypy finds the packages from the current directory
    try:
        out, err, code = mypy_api.run(argv)
    finally:
        os.chdir(here)
    return out + err, code


@pytest.fixture(scope="module")
def errors_by_module(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[str]], str, int]:
    """One mypy run over the suite with the exceptions' errors shown (``ignore_errors`` only hides a module's
    errors, it changes no other module's), each error line under its module: both tests read it (two runs
    were 92 s of the test command on 2 cores)."""
    folder = tmp_path_factory.mktemp("mypy")
    config = folder / "no-exceptions.toml"
    config.write_text(PYPROJECT.read_text().replace("ignore_errors = true", "ignore_errors = false"))
    said, code = _mypy(folder / "packages", config)
    errors: dict[str, list[str]] = {}
    for line in said.splitlines():
        if ": error:" in line:
            module = line.split(":", 1)[0].removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            errors.setdefault(module, []).append(line)
    return errors, said, code


@pytest.mark.slow
def test_the_suite_type_checks(errors_by_module: tuple[dict[str, list[str]], str, int]) -> None:
    errors, said, code = errors_by_module
    outside = [line for module, lines in errors.items() if module not in EXCEPTIONS for line in lines]
    assert code in (0, 1) and not outside, (  # 2: mypy itself failed (its configuration, a crash)
        "mypy found errors (pyproject.toml's [tool.mypy] lists the modules excepted):\n" + "\n".join(outside or [said])
    )


@pytest.mark.slow
def test_every_listed_exception_still_has_errors(errors_by_module: tuple[dict[str, list[str]], str, int]) -> None:
    """Without the exceptions, each listed module has an error; one that has none leaves the list."""
    errors, _, _ = errors_by_module
    clean = sorted(set(EXCEPTIONS) - set(errors))
    assert not clean, f"these modules type-check now; take them off pyproject.toml's exceptions: {clean}"
