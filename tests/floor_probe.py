"""What a gradient floor of FACTOR times today's stored-dtype share would judge: the limit FLA's one-ulp dg error
was held to on the committed H100 case, and dg of the planted bf16 cumulative sum
(tests/plugins/kda_planted_backward.py) and of the baseline on bf16 cases near the floor.

``python tests/floor_probe.py FACTOR`` prints one JSON line per (case, backend): dg's worst error over its limit
and how many dg records failed (a failure within 1.5 times its limit is judged again on fresh draws, as in a
run). FACTOR 1 is today's rule; 2 allows one ulp per element. The committed H100 case first, then the two of
tests/test_gradients.py's NEAR_THE_FLOOR.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main(factor: float) -> None:
    sys.path[:0] = [str(HERE / "plugins"), str(HERE / "support"), str(HERE)]
    import kda_planted_backward  # noqa: F401  (registers the plants)
    import torch
    from test_gradients import NEAR_THE_FLOOR

    import kda_conformance.running.gradient_truth as truth
    from kda_cases.case import Case
    from kda_conformance.checks import get_check, run_check
    from kda_conformance.running.config import RunConfig
    from kda_conformance.running.run import Run
    from kda_kernels import registry

    budgets = truth._budgets

    def scaled(case, reference, errors, scales, rule, roundoff=0.0, part=None):  # type: ignore[no-untyped-def]
        rule = dataclasses.replace(rule, floor_ulps=rule.floor_ulps * factor)
        return budgets(case, reference, errors, scales, rule, roundoff, part)

    truth._budgets = scaled
    cpu = torch.device("cpu")
    run = Run(RunConfig(device=cpu, backends=("torch_chunk",)), journal=False)
    committed = Case.from_json((HERE.parent / "docs/results/h100-gradients-2026-12-07/case.json").read_text())
    from kda_cases.materialize import materialize

    limit = truth.gradient_truth(materialize(committed, cpu)).sequence_budgets[22]["dg"].rel_rms.value
    # FLA's dg of that sequence alone measured 3.793e-4 (tests/gradient_probe.py, and on the H100)
    print(json.dumps({"factor": factor, "case": committed.label, "sequence 22 dg rel_rms limit": limit}))
    for case in [committed, *NEAR_THE_FLOOR]:
        for name in ("torch_chunk", "planted_bwd_dg_cumsum_bf16"):
            dg = [
                f for f in run_check(get_check("gradients"), case, registry.get(name), cpu, {}, run) if f.tensor == "dg"
            ]
            worst = max(f.worst for f in dg)
            print(json.dumps({"factor": factor, "case": case.label, "backend": name, "dg_worst": round(worst, 3),
                              "dg_failed": sum(f.failed for f in dg), "dg_records": len(dg)}))  # fmt: skip


if __name__ == "__main__":
    main(float(sys.argv[1]))
