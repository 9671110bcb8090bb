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


def _mypy(folder: Path, config: Path = PYPROJECT) -> tuple[str, int]:
    """mypy over every package seen under its import name (a folder of links: mypy does not run the
    editable install's import hook), with ``config`` and the cache in the repo."""
    folder.mkdir()
    for name, source in PACKAGES.items():
        (folder / name).symlink_to(ROOT / source, target_is_directory=True)
    # A cache per configuration: the two tests may run at once (pytest-xdist).
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


@pytest.mark.slow
def test_the_suite_type_checks(tmp_path: Path) -> None:
    said, code = _mypy(tmp_path / "packages")
    assert code == 0, f"mypy found errors (pyproject.toml's [tool.mypy] lists the modules excepted):\n{said}"


@pytest.mark.slow
def test_every_listed_exception_still_has_errors(tmp_path: Path) -> None:
    """Without the exceptions, each listed module has an error; one that has none leaves the list."""
    config = tmp_path / "no-exceptions.toml"
    config.write_text(PYPROJECT.read_text().replace("ignore_errors = true", "ignore_errors = false"))
    said, _ = _mypy(tmp_path / "packages", config)
    failing = {
        line.split(":", 1)[0].removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for line in said.splitlines()
        if ": error:" in line
    }
    clean = sorted(set(EXCEPTIONS) - failing)
    assert not clean, f"these modules type-check now; take them off pyproject.toml's exceptions: {clean}"
