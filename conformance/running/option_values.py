"""A run option's value as it is written (on a command line, in a pytest option, in a variable), read and
checked: each parser's error names the option and the values it takes. Text only, no torch, so a command
builds its parser without importing torch; the run's configuration (config.py) checks the rest."""

from __future__ import annotations

from collections.abc import Sequence

from kda_cases.case import DTYPES, INT64_MAX, did_you_mean

DEFAULT_CASE_TIMEOUT = 900.0  # seconds for one case on one backend, its reference and compile included
STRICT_VARIABLE = "KDA_STRICT"
PROFILE_VARIABLE = "KDA_PROFILE"
RUN_ID_VARIABLE = "KDA_RUN_ID"
# What made a run (kda_reports.store's purposes): a front end that runs pytest for a purpose of its own
# (a night, detection, ``checks --run``) tells its session through this variable; a plain session is "pytest".
PURPOSE_VARIABLE = "KDA_RUN_PURPOSE"
SHARD_VARIABLE = "KDA_SHARD"


class ConfigError(ValueError):
    """An option's value is not allowed. ``option`` is its name without dashes (``device``, ``backend``):
    each front end shows it under its own spelling (``--device``, ``--kda-device``). An environment variable
    that only the environment sets (``KDA_LEDGER``) is named as it is in every front end."""

    def __init__(self, option: str, message: str) -> None:
        self.option, self.message = option, message
        super().__init__(self.shown_as(""))

    def shown_as(self, prefix: str) -> str:
        """The message with the option spelled ``--{prefix}{option}`` (a variable's name as it is)."""
        spelled = self.option if self.option.isupper() else f"--{prefix}{self.option}"
        return f"{spelled}: {self.message}"


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"37,2048"`` -> ``(37, 2048)``; every length must be a positive integer."""
    if any(not x.strip() for x in text.split(",")):  # "37,,64" ran as 37,64: a lost value is a typo
        raise ValueError(f"lengths must be comma-separated integers with none left empty, got {text!r}")
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"lengths must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"lengths must be positive integers, got {text!r}")
    return values


def parse_count(what: str, text: str, lowest: int = 1) -> int:
    """A whole number of at least ``lowest``; the error names ``what``."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} must be an integer >= {lowest}, got {text!r}") from None
    if value < lowest:
        raise ValueError(f"{what} must be an integer >= {lowest}, got {value}")
    if value > INT64_MAX:  # a run's parquet stores it in 64 bits
        raise ValueError(f"{what} must be an integer from {lowest} to 2^63 - 1, got {text[:40]}...")
    return value


def parse_head_dim(text: str) -> int:
    """The grid's K = V: any whole number a case takes (``--case '{"head_k_dim": 50}'`` runs, so the option
    takes 50 too); a backend whose kernels take only some sizes refuses the others through its envelope,
    naming the field."""
    return parse_count("head dim", text)


def parse_positive(what: str, text: str) -> float:
    """A finite number > 0; the error names ``what``."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{what} must be a finite number > 0, got {text}")
    return value


def parse_choices(what: str, text: str, allowed: Sequence[str]) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")``, each one of ``allowed``; the error names ``what`` and the allowed values."""
    values = tuple(x.strip() for x in text.split(","))
    bad = [x for x in values if x not in allowed]
    if bad:
        hints = "".join(did_you_mean(x, allowed) for x in bad)
        said = "an empty item" if "" in bad else bad
        raise ValueError(f"{what} {said} not allowed in {text!r}{hints}; choose from {', '.join(allowed)}")
    return values


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> ``(2, 4)``: the second of four shards (1-based)."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"shard must be I/N, the I-th of N shards (1 <= I <= N), got {text!r}") from None
    if not 1 <= index <= count:
        raise ValueError(f"shard must be I/N with 1 <= I <= N, got {text!r}")
    return index, count


def parse_dtypes(text: str) -> tuple[str, ...]:
    """``"bf16,fp32"`` -> ``("bf16", "fp32")``, each one of the case dtypes."""
    return parse_choices("dtypes", text, DTYPES)
