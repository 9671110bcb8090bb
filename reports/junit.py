"""A run's records as JUnit XML, the test report every CI system reads (``kda-conformance run --junit-xml``):
one test case per (case, backend, check), failed or erred as its worst record, with the worst error/limit,
the reason and the repro line, as pytest's own JUnit XML carries them for the suite's pytest runs."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd

from kda_cases.files import atomic_write_text
from kda_reports.findings import worst_first_rank, worst_ratios, worst_tier

# Characters XML 1.0 cannot hold (control characters; a lone surrogate is escaped before this).
NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def junit_xml(records: pd.DataFrame, suite: str = "kda-conformance") -> str:
    """The records as one ``<testsuite>``."""
    cases = []
    keys = ["case_id", "backend", "check"]
    for (case_id, backend, check), part in records.groupby(keys, sort=False):
        worst_row = part.assign(rank=worst_first_rank(part["verdict"])).sort_values("rank").iloc[0]
        cases.append((case_id, backend, check, part, worst_row))
    root = ET.Element("testsuite", name=suite, tests=str(len(cases)))
    counts = {"failures": 0, "errors": 0, "skipped": 0}
    for case_id, backend, check, part, row in cases:
        label = str(row.get("label", "") or "")
        seconds = pd.to_numeric(part.get("seconds"), errors="coerce").fillna(0).sum() if "seconds" in part else 0
        element = ET.SubElement(
            root, "testcase", classname=_text(f"kda.{backend}.{check}"), name=_text(f"{case_id} {label}".strip()),
            time=f"{float(seconds):.3f}",
        )  # fmt: skip
        properties = ET.SubElement(element, "properties")
        worst = worst_ratios(part).max()
        tier = worst_tier(part["tier"].fillna("").astype(str)) if "tier" in part else ""
        for name, value in (("backend", backend), ("check", check), ("case_id", case_id),
                            ("worst_ratio", "" if math.isnan(worst) else f"{worst:.4g}"), ("tier", tier),
                            ("repro", str(row.get("repro", "") or ""))):  # fmt: skip
            ET.SubElement(properties, "property", name=name, value=_text(value))
        verdict, reason = str(row["verdict"]), str(row.get("reason", "") or "")
        message = _text(f"{f'[{tier}] ' if tier else ''}{row.get('tensor', '') or 'call'}: {reason}".strip())
        repro = _text(row.get("repro", "") or "")
        if verdict == "fail":
            counts["failures"] += 1
            ET.SubElement(element, "failure", message=message[:500]).text = f"{message}\nrepro: {repro}"
        elif verdict == "error":
            counts["errors"] += 1
            ET.SubElement(element, "error", message=message[:500]).text = f"{message}\nrepro: {repro}"
        elif verdict in ("skip", "resource") and (part["verdict"] != "pass").all():
            counts["skipped"] += 1
            ET.SubElement(element, "skipped", message=_text(reason)[:500])
    for name, value in counts.items():
        root.set(name, str(value))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _text(value: object) -> str:
    """Any text a backend or a case gave, as XML can hold it: surrogates escaped, control characters out."""
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return NOT_XML.sub("?", text)


def write_junit(records: pd.DataFrame, path: Path) -> Path:
    atomic_write_text(Path(path), junit_xml(records))
    return Path(path)
