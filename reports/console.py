"""Records as terminal lines: what ``-v`` prints as each record is measured, and the run's table."""

from __future__ import annotations

RECORD_LINE_HEADER = (
    f"{'case':17} {'label':42} {'backend':14} {'tensor':12} {'verdict':7} {'max_abs':>9} {'budget':>9} "
    f"{'ratio':>6} {'rel_rms':>9} {'rms_lim':>9} {'s':>7}"
)


def record_line(r: dict) -> str:
    """One record on one line, under RECORD_LINE_HEADER."""

    def num(key: str, width: int = 9, spec: str = ".2e") -> str:
        value = r.get(key)
        return f"{value:{width}{spec}}" if isinstance(value, float) and value == value else f"{'':{width}}"

    return (
        f"{r['case_id']:17} {r['label'][:42]:42} {r['backend']:14} {r['tensor'] or '-':12} "
        f"{r['verdict']:7} {num('max_abs')} {num('budget')} {num('ratio', 6, '.2f')} {num('rel_rms')} "
        f"{num('budget_rel_rms')} {r['seconds']:7.2f}"
    )
