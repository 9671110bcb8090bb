"""Replay of autotune's choices: a cold machine launches the config a warm one chose, instead of tuning.

Most of a cold compile is autotuning: ``triton.autotune`` compiles and times every config of its list for
each new key, although this suite measures accuracy, not speed. A warm run with ``KDA_AUTOTUNE_RECORD=DIR``
writes, from each of its processes, the config every autotuned kernel chose for every key it met
(``DIR/autotune-<pid>.json``); ``kda-conformance autotune --from DIR`` merges them into this GPU model's
file, ``kernels/autotune/<gpu>.json`` (kept in the repo, dated; each key by a 12-digit hash of its text,
grouped under the config chosen for it, so 800 keys take about 20 KB). On any machine of that model
the suite then hands each kernel the recorded config before its first launch of a known key, so autotune
benchmarks nothing: the config a warm machine picks, so the same verdicts. A key the file does not hold
tunes as before and says so, once per kernel. ``KDA_AUTOTUNE_REPLAY=0`` switches replay off.

It works on Triton's own ``Autotuner`` (the class behind ``triton.autotune``), so one mechanism serves
FLA's kernels and the vendored trees' (AITER's, vLLM's, SGLang's copies) alike: the autotuner's cache of
chosen configs is given a miss handler that looks the key up in the file and takes the matching config
from the kernel's own list (a file whose config is no longer in the list tunes, as an unknown key does).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import sys
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FOLDER = Path(__file__).with_name("autotune")
REPLAY_VARIABLE = "KDA_AUTOTUNE_REPLAY"  # "0": tune as Triton does; a path: replay that file
RECORD_VARIABLE = "KDA_AUTOTUNE_RECORD"  # a folder: each process writes the choices it met there
PART = "autotune-{pid}.json"  # what each recording process names its file in that folder

Choices = dict[str, dict[str, dict]]  # kernel -> key id (``key_id``) -> config

# pinned: the kernel launches pin (see pinned); window: the kernels launched inside ``launches``, or None.
_state: dict = {
    "installed": False,
    "choices": {},
    "source": "",
    "replayed": 0,
    "told": set(),
    "pinned": {},
    "window": None,
}
_seen: weakref.WeakSet = weakref.WeakSet()  # the autotuners this process ran, for recording
_recorded_count = [0]


def gpu_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``: the GPU model's file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def file_for(device_name: str) -> Path:
    return FOLDER / f"{gpu_slug(device_name)}.json"


def kernel_name(autotuner: object) -> str:
    """The autotuned kernel's module and name, stable across processes and machines: Triton's ``base_fn``
    (the Python function under the JIT and any heuristics), or the innermost ``fn``."""
    fn = getattr(autotuner, "base_fn", None)
    if fn is None:
        fn = autotuner
        while hasattr(fn, "fn") and fn.fn is not fn:
            fn = fn.fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


def key_text(key: tuple) -> str:
    """An autotune key (argument values and dtype names) as text that is the same in every process."""
    return json.dumps([k if isinstance(k, bool | int | float | str) or k is None else str(k) for k in key])


def key_id(text: str) -> str:
    """A key's name in the file: the first 12 hex digits of the SHA-1 of its ``key_text``. A key's text
    repeats every argument's dtype (20 names for FLA's kernels); hashed, 800 keys take 20 KB, not 240.
    An id is already its own id, so older files and parts, which hold the texts, still load."""
    if len(text) == 12 and all(c in "0123456789abcdef" for c in text):
        return text
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def config_dict(config: object) -> dict:
    return {
        "kwargs": dict(getattr(config, "kwargs", {})),
        "num_warps": getattr(config, "num_warps", None),
        "num_stages": getattr(config, "num_stages", None),
        "num_ctas": getattr(config, "num_ctas", None),
        "maxnreg": getattr(config, "maxnreg", None),
    }


class ReplayCache(dict):
    """An autotuner's cache of chosen configs that, on a miss, takes the recorded choice for the key."""

    def __init__(self, autotuner: object, entries: dict) -> None:
        super().__init__(entries)
        self._autotuner = weakref.ref(autotuner)

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        autotuner: Any = self._autotuner()
        if autotuner is None or not isinstance(key, tuple):
            return False
        name = kernel_name(autotuner)
        if name in _state["pinned"]:  # every key of a pinned kernel launches the pinned config (see pinned)
            config = next((c for c in autotuner.configs if config_dict(c) == _state["pinned"][name]), None)
            if config is None:
                raise ValueError(f"{name}: the pinned config {_state['pinned'][name]} is not in its list")
            dict.__setitem__(self, key, config)
            return True
        recorded = _state["choices"].get(name, {}).get(key_id(key_text(key)))
        config = None
        if recorded is not None:
            config = next((c for c in autotuner.configs if config_dict(c) == recorded), None)
        if config is None:
            if _state["choices"] and name not in _state["told"]:
                _state["told"].add(name)
                why = "its recorded config is not in its list" if recorded is not None else "no recorded choice"
                sys.stderr.write(f"kda-conformance: autotune replay: {name} key {key_text(key)}: {why}; tuning\n")
            return False
        dict.__setitem__(self, key, config)
        _state["replayed"] += 1
        return True


def _record() -> None:
    folder = os.environ.get(RECORD_VARIABLE)
    if not folder:
        return
    choices = recorded_choices()
    count = sum(len(keys) for keys in choices.values())
    if count == _recorded_count[0]:
        return
    _recorded_count[0] = count
    path = Path(folder) / PART.format(pid=os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    import torch  # here: merging and reading replay files (kda-conformance autotune, shards) needs no torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    part = path.with_suffix(".tmp")
    part.write_text(json.dumps({"device": device, "triton": _triton_version(), "choices": choices}))
    part.replace(path)  # a process that dies mid-write leaves the previous part whole


def parts(folder: Path) -> list[Path]:
    """The part files a recording into ``folder`` wrote (one per process), in order; none where it is no folder."""
    return sorted(Path(folder).glob(PART.format(pid="*"))) if Path(folder).is_dir() else []


def recorded_choices() -> Choices:
    """What the autotuners this process ran chose, per kernel and key."""
    choices: Choices = {}
    for autotuner in list(_seen):
        for key, config in dict(getattr(autotuner, "cache", {})).items():
            choices.setdefault(kernel_name(autotuner), {})[key_id(key_text(key))] = config_dict(config)
    return choices


def _triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return ""


def install(choices: Choices, source: str = "") -> None:
    """Replay ``choices`` (and record, where RECORD_VARIABLE names a folder) in every autotuned kernel of this
    process, from its next launch on."""
    from triton.runtime.autotuner import Autotuner

    _state.update(choices=choices, source=source)
    if _state["installed"]:
        return
    original = Autotuner.run

    def run(self, *args, **kwargs):
        if not isinstance(self.cache, ReplayCache):
            self.cache = ReplayCache(self, self.cache)
        _seen.add(self)
        if _state["window"] is not None:
            _state["window"][kernel_name(self)] = list(self.configs)
        try:
            return original(self, *args, **kwargs)
        finally:
            _record()

    Autotuner.run = run
    _state.update(installed=True, original=original)


@contextlib.contextmanager
def launches() -> Iterator[dict[str, list]]:
    """The autotuned kernels launched within the block (kernel name -> its list of configs), filled as they
    launch. Installs the hook that sees them (with this process's recorded choices, if any)."""
    install(_state["choices"], _state["source"])
    window: dict[str, list] = {}
    _state["window"] = window
    try:
        yield window
    finally:
        _state["window"] = None


@contextlib.contextmanager
def pinned(kernel: str, config: dict) -> Iterator[None]:
    """Within the block every launch of ``kernel`` (a name ``launches`` gave) takes ``config`` (a ``config_dict``
    of one of its configs), whatever autotune chose or would choose; the other kernels keep their choices. The
    pinned kernel's chosen configs are set aside for the block, and every autotuner's cache is as before after
    it, so no choice is tuned again."""
    install(_state["choices"], _state["source"])
    kept = {tuner: dict(tuner.cache) for tuner in list(_seen)}
    for tuner in kept:
        if kernel_name(tuner) == kernel:
            tuner.cache = ReplayCache(tuner, {})
    _state["pinned"] = {kernel: config}
    try:
        yield
    finally:
        _state["pinned"] = {}
        for tuner, cache in kept.items():
            tuner.cache = ReplayCache(tuner, cache)


def uninstall() -> None:
    """Triton's autotuner as it was before ``install`` (for tests)."""
    from triton.runtime.autotuner import Autotuner

    if _state["installed"]:
        Autotuner.run = _state.pop("original")
    _state.update(installed=False, choices={}, source="", replayed=0, told=set(), pinned={}, window=None)


def activate(device: torch.device) -> str:
    """On a GPU, replay this GPU model's recorded choices (and record where asked), once per process; the
    file replayed, or why none is. Called before a backend's first call."""
    if device.type != "cuda" or _state["installed"]:
        return _state["source"]
    setting = os.environ.get(REPLAY_VARIABLE, "")
    if setting == "0" and not os.environ.get(RECORD_VARIABLE):
        return "off"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "no triton"
    choices: Choices = {}
    source = "off"
    if setting != "0":
        import torch

        path = Path(setting) if setting else file_for(torch.cuda.get_device_name(device))
        if path.exists():
            choices, source = load(path), str(path)
    install(choices, source)
    return source


def load(path: Path) -> Choices:
    return _choices(json.loads(Path(path).read_text()).get("choices", {}))


def _choices(stored: dict) -> Choices:
    """A file's or a part's choices, kernel -> key id -> config: from the file's groups (``[config, [ids]]``
    per config chosen) or a mapping of keys (parts, and older files)."""
    choices: Choices = {}
    for kernel, entries in stored.items():
        if isinstance(entries, list):
            choices[kernel] = {key_id(key): config for config, keys in entries for key in keys}
        else:
            choices[kernel] = {key_id(key): config for key, config in entries.items()}
    return choices


def merge(parts: Iterable[Path]) -> tuple[str, str, Choices]:
    """The device, Triton version and choices of a recording's part files; parts of two GPU models or two
    Triton versions are refused (a choice is one model's and one compiler's)."""
    devices: set[str] = set()
    versions: set[str] = set()
    choices: Choices = {}
    for part in parts:
        data = json.loads(Path(part).read_text())
        devices.add(data["device"])
        versions.add(data["triton"])
        for kernel, keys in _choices(data["choices"]).items():
            choices.setdefault(kernel, {}).update(keys)
    if len(devices) != 1 or len(versions) != 1:
        raise ValueError(f"the parts were recorded on {sorted(devices)} with Triton {sorted(versions)}: one of each")
    return devices.pop(), versions.pop(), _in_order(choices)


def _in_order(choices: Choices) -> Choices:
    return {k: dict(sorted(v.items())) for k, v in sorted(choices.items())}


def keep_earlier(path: Path, device: str, triton: str, choices: Choices) -> tuple[Choices, int]:
    """The file's choices with the new ones over them, and how many of the file's keys were kept; a file of
    another GPU model or Triton version is refused (its choices are not this one's)."""
    data = json.loads(Path(path).read_text())
    if (data.get("device"), data.get("triton")) != (device, triton):
        raise ValueError(
            f"the file holds {data.get('device')} with Triton {data.get('triton')}, the parts {device} with Triton "
            f"{triton}"
        )
    merged = _choices(data.get("choices", {}))
    for kernel, keys in choices.items():
        merged.setdefault(kernel, {}).update(keys)
    # Every new key is in the merged file: the rest are the file's own.
    kept = sum(map(len, merged.values())) - sum(map(len, choices.values()))
    return _in_order(merged), kept


def write(path: Path, device: str, triton: str, choices: Choices, command: str = "") -> Path:
    """The GPU model's file: a header, then per kernel one line per config chosen with the ids of its keys
    (a line per group keeps a re-recording's diff readable)."""
    head = {
        "device": device,
        "triton": triton,
        "recorded": datetime.date.today().isoformat(),
        "command": command,
        "kernels": len(choices),
        "keys": sum(len(v) for v in choices.values()),
    }
    kernels = []
    for kernel, keys in sorted(choices.items()):
        groups: dict[str, list[str]] = {}
        for key, config in keys.items():
            groups.setdefault(json.dumps(config, sort_keys=True), []).append(key)
        rows = sorted(([json.loads(c), sorted(ids)] for c, ids in groups.items()), key=lambda g: (-len(g[1]), g[1]))
        lines = ",\n".join("   " + json.dumps(row, separators=(",", ":"), sort_keys=True) for row in rows)
        kernels.append(f"  {json.dumps(kernel)}: [\n{lines}\n  ]")
    body = ",\n".join(kernels)
    text = json.dumps(head, indent=1)[: -len("\n}")] + f',\n "choices": {{\n{body}\n }}\n}}\n'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def replayed() -> int:
    """How many launches of a new key took a recorded choice in this process."""
    return int(_state["replayed"])
