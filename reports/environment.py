"""What a run ran on: device, library versions, the variables that move numbers, and the suite's own commit."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_REPO = Path(__file__).resolve().parent.parent


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def suite_commit() -> tuple[str, str]:
    """The suite's commit and where it was read: ``KDA_SUITE_COMMIT`` (a copy without its git folder names
    it), the project's own git checkout (``+dirty`` with uncommitted changes; only where the checkout's top
    level is the project itself, never a repository the project sits inside), or the installed package's
    metadata (a pip install from git); else ``unknown``."""
    if os.environ.get("KDA_SUITE_COMMIT"):
        return os.environ["KDA_SUITE_COMMIT"], "KDA_SUITE_COMMIT"
    commit = _checkout_commit()
    if commit:
        return commit, "git"
    commit = _installed_commit()
    if commit:
        return commit, "package metadata"
    return "unknown", "unknown"


def _git(*args: str, cwd: Path = _REPO) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _own_checkout_head(folder: Path) -> str:
    """HEAD of ``folder``'s git checkout, only where the checkout's top level is ``folder`` itself (never a
    repository it sits inside: an installed copy inside another repository, say); else ''."""
    top = _git("rev-parse", "--show-toplevel", cwd=folder)
    if not top or Path(top).resolve() != folder.resolve():
        return ""
    return _git("rev-parse", "--short=12", "HEAD", cwd=folder)


def _checkout_commit() -> str:
    commit = _own_checkout_head(_REPO)
    if not commit:
        return ""
    dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=_REPO)
    return f"{commit}+dirty" if dirty else commit


def _installed_commit() -> str:
    """The commit pip recorded for an install from a repository (``direct_url.json``), if any."""
    try:
        text = importlib.metadata.distribution("kda-conformance").read_text("direct_url.json")
        commit = json.loads(text or "{}").get("vcs_info", {}).get("commit_id", "")
    except (importlib.metadata.PackageNotFoundError, ValueError, AttributeError):
        return ""
    return str(commit)[:12]


# The variables that can move a kernel's numbers or choose its code path, by prefix or by name: Triton's
# (TRITON_F32_DEFAULT moves fp32 errors by 100x), torch's, CUDA's and HIP's, the kernels' own switches
# (FLA, AITER, FlashKDA's segmentation), BLAS and oneDNN settings, CPU dispatch, thread counts, the
# suite's own. Paths and caches are left out: they differ between machines without changing a number.
NUMERICS_PREFIXES = (
    "TRITON_", "TORCH_", "CUDA_", "HIP_", "ROCM_", "HSA_", "AITER_", "FLA_", "KDA_", "CHUNK_DELTA_ATTN_",
    "CUBLAS_", "CUBLASLT_", "HIPBLASLT_", "ROCBLAS_", "MIOPEN_", "ONEDNN_", "DNNL_", "NVIDIA_TF32",
)  # fmt: skip
NUMERICS_NAMES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
    "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY",
)  # fmt: skip
NOT_NUMERICS_SUFFIXES = ("_DIR", "_HOME", "_PATH", "_SRC", "_ARTIFACTS", "_CACHE_AUTOTUNING", "_SUITE_COMMIT")
# The class every run's limits derive from (the working-precision baseline, registered as torch_chunk):
# a plugin that registers another under that name changes every limit, so each run records which it used.
SUITE_BASELINE = "kda_kernels.torch_chunk.TorchChunk"

# A variable whose name says it holds a secret is recorded by its name, never its value: a word anywhere in
# the name, or a whole part of it between underscores (PAT inside PATTERN or PATH says nothing).
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "AUTH", "CREDENTIAL", "BEARER", "COOKIE")
SECRET_PARTS = ("PASS", "PAT", "PW", "PWD", "CRED", "CREDS", "PASSCODE", "PRIVATE", "SESSION", "SALT")
REDACTED = "<redacted>"
# A URL's user and password in any recorded value (a proxy or a cache server named in a TRITON_* variable): all
# up to the last "@" of the URL, so a password holding "/" or "@" goes too.
URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]{0,31}://)[^\s\"'<>@]*(?:@[^\s\"'<>@/]*)*@")
_SECRET_NAMES = r"(?:password|passwd|passphrase|passcode|secret|token|api[_-]?key|access[_-]?key|private[_-]?key)"
# Values that are credentials by their shape, whatever the variable holding them is called: the issuers'
# token formats, a bearer header, a secret in a query string or a key=value list, a private key, a JWT.
# What a ``keep`` group matched stays (the parameter's name, the header's word); the rest is redacted.
SECRET_SHAPES = {
    "GitHub token": r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})",
    "GitLab token": r"\bglpat-[A-Za-z0-9_-]{20,}",
    "Hugging Face token": r"\bhf_[A-Za-z0-9]{30,}",
    "API key (sk-)": r"\bsk-[A-Za-z0-9_-]{20,}",
    "AWS access key": r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    "Slack token": r"\bxox[abposr]-[A-Za-z0-9-]{10,}",
    "JSON web token": r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
    "authorization header": r"(?i)(?P<keep>\b(?:bearer|basic|token) )[A-Za-z0-9._~+/=-]{8,}",
    "secret parameter": (
        r"(?i)(?P<keep>(?:^|[?&;,\s\"'])(?:[a-z0-9]+[_-])*(?:password|passwd|pwd|pass|token|secret|api[_-]?key|"
        r"access[_-]?key|auth|credentials?)=)[^&;,\s\"']+"
    ),
    "Slack webhook": r"(?P<keep>https://hooks\.slack\.com/)(?:services|workflows|triggers)/[A-Za-z0-9_/-]+",
    "PyPI token": r"\bpypi-[A-Za-z0-9_-]{40,}",
    "npm token": r"\bnpm_[A-Za-z0-9]{36}\b",
    "Google API key": r"\bAIza[0-9A-Za-z_-]{35}",
    "Azure SAS signature": r"(?i)(?P<keep>[?&]sig=)[^&\s\"']+",
    "secret option": rf"(?i)(?P<keep>(?:^|\s)--?(?:[a-z0-9]+-)*{_SECRET_NAMES}(?:=|\s+))(?!<redacted>)[^\s\"']+",
    "JSON or YAML secret": (
        rf"(?im)(?P<keep>(?:\"(?:[a-z0-9]+[_-])*{_SECRET_NAMES}\"\s*:\s*\"?|^\s*(?:[a-z0-9]+[_-])*{_SECRET_NAMES}\s*:\s*"
        rf"[\"']?))(?!<redacted>)[^\"'\s,}}]+"
    ),
    "private key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----(?s:.*?)(?:-----END [A-Z ]*PRIVATE KEY-----|$)",
}
_SHAPES = [re.compile(pattern) for pattern in SECRET_SHAPES.values()]


@functools.lru_cache(maxsize=4096)  # records repeat their texts: 36,000 calls of 18 patterns in a detection run
def redact(text: str) -> str:
    """``text`` with every credential its shape gives away (SECRET_SHAPES, a URL's user and password)
    replaced by ``<redacted>``: a token pasted into a variable or an option of any name stays out of the
    records."""
    for shape in _SHAPES:
        text = shape.sub(lambda m: (m.groupdict().get("keep") or "") + REDACTED, text)
    return URL_CREDENTIALS.sub(rf"\g<scheme>{REDACTED}@", text)


def looks_secret(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS) or any(part in SECRET_PARTS for part in upper.split("_"))


def numerics_variables(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables set that can change a kernel's numbers or path (NUMERICS_PREFIXES,
    NUMERICS_NAMES), the value of any whose name looks like a credential replaced by ``<redacted>``."""
    environ = dict(os.environ if environ is None else environ)
    chosen = {
        name: value
        for name, value in sorted(environ.items())
        if (name.startswith(NUMERICS_PREFIXES) or name in NUMERICS_NAMES) and not name.endswith(NOT_NUMERICS_SUFFIXES)
    }
    return {name: REDACTED if looks_secret(name) else redact(value) for name, value in chosen.items()}


def source_tree_commits(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The commit of each kernel source tree a ``KDA_*_SRC`` variable names (AITER's, vLLM's, SGLang's), keyed
    by the variable: ``git rev-parse`` in the tree's own checkout, else a ``COMMIT`` file at its root, else
    ``unknown``."""
    environ = dict(os.environ if environ is None else environ)
    commits = {}
    for name, source in sorted(environ.items()):
        if not (name.startswith("KDA_") and name.endswith("_SRC") and source):
            continue
        commit = _own_checkout_head(Path(source))
        marker = Path(source) / "COMMIT"
        commits[name] = commit or (marker.read_text().strip()[:40] if marker.is_file() else "unknown")
    return commits


def library_version(distribution: str = "", source_variable: str = "") -> str:
    """The version of a backend's library as the run uses it: the commit of the source tree ``source_variable``
    names where it is set (``KDA_VLLM_SRC``: the kernels load from there), else the installed
    ``distribution``'s version, else ``not installed``."""
    if source_variable and os.environ.get(source_variable):
        commit = source_tree_commits({source_variable: os.environ[source_variable]})[source_variable]
        return f"{commit} ({source_variable})"
    return (_version(distribution) if distribution else "") or "not installed"


def library_versions(libraries: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    """``{name: version}`` of libraries given as ``{name: (distribution, source_variable)}``."""
    return {name: library_version(*where) for name, where in sorted(libraries.items())}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device, libraries: Mapping[str, tuple[str, str]] | None = None) -> dict[str, str | int]:
    """A flat description of the machine and libraries, stored beside every record: ``libraries`` are the
    run's backends' (``{name: (distribution, source_variable)}``), their versions recorded as JSON."""
    import torch  # here, not at the top: --version and the store's readers start without it

    from kda_cases.devices import gpu_arch

    env: dict[str, str | int] = {
        "device_type": device.type,
        "device_name": cpu_model(),
        "arch": platform.machine(),
        "multiprocessors": 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "fla": _version("fla-core"),
        "aiter": _version("aiter"),
        "source_trees": json.dumps(source_tree_commits(), sort_keys=True),
        "libraries": json.dumps(library_versions(libraries or {}), sort_keys=True),
        # The commit and where it was read (KDA_SUITE_COMMIT, git, package metadata or unknown).
        **dict(zip(("suite_commit", "suite_commit_from"), suite_commit(), strict=True)),
        "variables": json.dumps(numerics_variables(), sort_keys=True),
        "hostname": platform.node(),
        "date": datetime.now(UTC).isoformat(timespec="milliseconds"),  # orders runs started within a second
    }
    if device.type == "cuda" and torch.cuda.is_available():
        env["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("HIP_VISIBLE_DEVICES") or ""
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["multiprocessors"] = props.multi_processor_count
        env["arch"] = gpu_arch(device)
        env["cuda"] = torch.version.cuda or ""
        env["hip"] = torch.version.hip or ""
    return env
