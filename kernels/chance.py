"""A kernel's sources of chance, fixed by one seed per run.

The same cells must take the same path in a resume or a replay, or the journal cannot serve
their model calls: ``for w in {"alpha", "beta"}: llm_query(w)`` asks in set order, which
follows the string hash, which Python randomizes per process. So every kernel of a run starts
with the run's seed (``--kernel-seed``, recorded with the run's options in the journal):

* the hash seed: ``PYTHONHASHSEED`` in the kernel's environment (:func:`chance_env`), so set
  and dict-of-hash order, ``hash(str)`` and everything built on them repeat (in the processes
  a cell starts too, which inherit it);
* :mod:`random`: the module's functions (``random.random``, ``shuffle``, ``sample``, ...)
  seeded when the kernel is bound (:func:`seed_kernel`);
* NumPy, if a cell imports it: its global functions (``np.random.rand``, ...) seeded at
  import, and ``np.random.default_rng()`` without a seed gets one derived from the run's seed
  and how many such generators came before.

Left to chance, as everywhere: ``os.urandom``, :mod:`secrets`, ``uuid.uuid4``,
``random.SystemRandom``, a ``random.Random()`` made without a seed, clocks, and the order in
which threads and processes run.

Imported inside every kernel by :mod:`kernels.runtime` (standard library only), and by the host
for :func:`chance_env`.
"""
from __future__ import annotations

import importlib.util
import itertools
import os
import random
import sys
from typing import Any

__all__ = ["SEED_ENV", "chance_env", "seed_kernel"]

#: The environment variable holding the run's seed in a kernel (the hash seed is the same).
SEED_ENV = "RLM_KERNEL_SEED"


def chance_env(seed: int) -> dict[str, str]:
    """The environment variables that fix a kernel's chance to ``seed`` (int, 0..2**32-1)."""
    return {"PYTHONHASHSEED": str(int(seed)), SEED_ENV: str(int(seed))}


def seed_kernel() -> int | None:
    """Seed :mod:`random` with the kernel's seed (:data:`SEED_ENV`), and NumPy now if it is
    imported, else once it is. Returns the seed, or None (no seed set: nothing changed)."""
    raw = os.environ.get(SEED_ENV)
    if not raw or not raw.isdigit():
        return None
    seed = int(raw)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np, "random"):
        _seed_numpy(np, seed)
    elif not any(isinstance(f, _SeedOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _SeedOnImport(seed))
    return seed


def _seed_numpy(np: Any, seed: int) -> None:
    """NumPy's global state seeded, and ``default_rng()`` without a seed made repeatable."""
    np.random.seed(seed)
    original = getattr(np.random.default_rng, "_rlm_original", np.random.default_rng)
    count = itertools.count()

    def default_rng(*args, **kwargs):
        if not args and kwargs.get("seed") is None:
            kwargs["seed"] = np.random.SeedSequence(seed, spawn_key=(next(count),))
        return original(*args, **kwargs)

    default_rng.__doc__ = original.__doc__
    default_rng._rlm_original = original  # type: ignore[attr-defined]
    np.random.default_rng = default_rng


class _SeedOnImport:
    """A meta path finder that seeds NumPy when a cell first imports it (then removes itself).

    It finds ``numpy`` through the other finders and wraps the loader's ``exec_module``, so the
    seeding happens right after NumPy's own import, before the cell uses it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "numpy":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _SeedingLoader(spec.loader, self.seed)
        return spec


class _SeedingLoader:
    """A loader that runs ``loader`` and then seeds the module (NumPy) it made."""

    def __init__(self, loader: Any, seed: int) -> None:
        self._loader, self._seed = loader, seed

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            _seed_numpy(module, self._seed)
        except Exception:  # an unusual NumPy: it is imported, unseeded
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
