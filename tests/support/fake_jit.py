"""What ``triton.autotune`` wraps, for tests of autotuning on the CPU: the argument names, the Python function
under the JIT (its module and name name the kernel) and ``run``, which launches by recording the config's
BLOCK. tests/test_autotune_replay.py and tests/test_autotune_configs.py tune it with Triton's own autotuner."""

from __future__ import annotations

from collections.abc import Callable


class FakeJit:
    arg_names = ("x", "n", "BLOCK")

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self.launched: list[int] = []

    def run(self, *args: object, **kwargs: int) -> None:
        self.launched.append(kwargs["BLOCK"])
