"""The suite's truth made slow (KDA_SLOW_TRUTH_S seconds per case, at import, so an isolated worker that loads
this plugin has it too) and a backend whose call takes KDA_SLOW_CALL_S seconds: what --case-timeout must
tell apart under --isolate (issue 51: the worker's whole check was timed as the backend's)."""

from __future__ import annotations

import os
import time

from kda_cases.materialize import KDAInputs
from kda_conformance.running import truth_cache
from kda_kernels.protocol import BackendOutput
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk

_get = truth_cache.TruthCache.get


def _slow_get(self, case, precision=None):
    time.sleep(float(os.environ.get("KDA_SLOW_TRUTH_S", "0")))
    return _get(self, case, precision)


truth_cache.TruthCache.get = _slow_get


class SlowCall(TorchChunk):
    name = "slow_call"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        time.sleep(float(os.environ.get("KDA_SLOW_CALL_S", "0")))
        return super().run(inputs)


register(SlowCall.name, SlowCall, replace=True)
