"""TEST DOUBLE: the dispatcher. Like AITER it imports the switch by name (its own binding of the constant)."""

from __future__ import annotations

import os

from .flash_kda import AITER_FDA_ENABLE, FLASH_KDA_CHUNK, flash_kda_supported

CALLS: list[dict] = []  # what each call received and which path it took, for the adapter's tests


def choose_path(chunk_size, **admission) -> tuple[str, int]:
    flash = AITER_FDA_ENABLE and flash_kda_supported(
        chunk_size=FLASH_KDA_CHUNK if chunk_size is None else chunk_size, **admission
    )
    return ("flash_kda" if flash else "default"), (chunk_size or (FLASH_KDA_CHUNK if flash else 64))


def record(**call) -> None:
    CALLS.append({**call, "segment": os.environ.get("CHUNK_DELTA_ATTN_FLASH_KDA_SEG")})
