"""The design card's bare folder names never shadow other installed packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from suite_paths import REPO


def test_bare_kernels_import_from_the_repo_root_finds_the_other_package(tmp_path: Path) -> None:
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'the other kernels package'\n")
    # `python -c` puts the working directory (the repo root, holding kernels/) first on sys.path.
    done = subprocess.run(
        [sys.executable, "-c", "import kernels; print(kernels.WHO)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(other.parent)},
        timeout=60,
    )
    assert done.stdout.strip() == "the other kernels package", done.stderr


def test_installed_names_are_the_kda_ones() -> None:
    import kda_kernels.protocol

    assert Path(kda_kernels.protocol.__file__).parent == REPO / "kernels"
