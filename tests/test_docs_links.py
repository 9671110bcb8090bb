"""The docs hold together: every relative link of the README, the docs and findings/README.md reaches a file, and
its anchor a heading there; reference pages keep no dated measurements (they live in the results journal,
docs/results/, a page per date, and a reference page's dated heading only points there)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), ROOT / "findings" / "README.md"]
# Pages made by a command from data of a day (their header says when), not reference text.
GENERATED = {"findings.md", "known-issues.md", "calibration.md", "calibration-ieee.md", "detection.md", "cli.md"}
DATED = re.compile(r"20\d\d-\d\d-\d\d")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings (lower case, punctuation dropped, spaces as hyphens)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def test_every_relative_link_reaches_its_file_and_heading() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = page.parent / path if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_reference_pages_point_their_dated_measurements_to_the_journal() -> None:
    """A dated section of a reference page (a night on the H200, a benchmark of a day) is one line pointing into
    docs/results/; its text lives there."""
    kept = []
    for page in sorted(DOCS.glob("*.md")):
        if page.name in GENERATED:
            continue
        sections = re.split(r"^(#{2,3} .*)$", page.read_text(), flags=re.M)
        for heading, body in zip(sections[1::2], sections[2::2], strict=True):
            if DATED.search(heading) and not re.fullmatch(
                r"\s*Moved to the results journal: \[[^\]]*\]\(results/[^)]+\)\.\s*", body
            ):
                kept.append(f"{page.name}: {heading}")
    assert not kept, "dated sections still in reference pages:\n" + "\n".join(kept)
