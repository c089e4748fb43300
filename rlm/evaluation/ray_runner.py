"""Running a sweep's trials on a Ray cluster (``rlm eval --ray ADDRESS``; the ``ray`` extra:
``pip install 'rlm-kernels[ray]'``).

Each trial is one Ray task (:func:`run_trial` in a worker process, one CPU, its own kernels);
results stream back to the driver as they finish (``ray.wait``) and the driver alone writes
them to ``OUT/trials.jsonl``, exactly as a local sweep does. The cluster's nodes need this
package (same version) and the sample maker importable; a ``--sample-factory`` module must be
on the workers' ``PYTHONPATH``.

Where the journals live. Each trial writes its run to the journal its spec names: ``rlm eval
--journal PATH|URL``, else ``OUT/journal.sqlite3`` (the absolute path of the driver's ``--out``):

* one machine (a local Ray head): every worker writes the one SQLite file; a killed sweep run
  again resumes each interrupted trial from it, as locally.
* several machines: either a *shared* journal every node reaches (a ``postgresql://`` URL as
  the ``--journal``; never SQLite on a network file system), so any node resumes any trial; or
  *one journal per node* (the default path, created on each node): finished trials are still
  skipped (the driver's ``trials.jsonl`` decides), but an interrupted trial resumes from its
  journal only if Ray places it on the same node again, otherwise it starts over (and pays
  again).

The API key: the variable the trials name (``OPENAI_API_KEY``, or the one ``--api-key`` is
put in) is passed to the workers in the job's ``runtime_env`` when the driver has it, so it
travels to the cluster (never into a record or ``sweep.json``).

A worker keeps one :class:`rlm.RLM` per endpoint for the trials it runs (so an embedded model
server is started once per worker process, not per trial); Ray retries a trial whose worker
died (its run id resumes it from the journal).
"""
from __future__ import annotations

import atexit
import os
from typing import Any, Iterator

from rlm.errors import ConfigError, RLMError, install_hint
from rlm.evaluation.trial import TrialSpec, run_trial, trial_record

#: Ray retries of a trial whose worker process died (the retry resumes from the journal).
MAX_RETRIES = 2

_RUNNERS: dict[tuple, Any] = {}


def _worker_runner(spec: TrialSpec) -> Any:
    """This worker process's :class:`rlm.RLM` for the spec's endpoint (closed at exit)."""
    key = (spec.base_url, spec.model, spec.api_key_env, spec.price_file, spec.embedded_threads,
           spec.embedded_slots)
    if key not in _RUNNERS:
        from rlm.api import RLM
        if not _RUNNERS:
            atexit.register(_close_runners)
        _RUNNERS[key] = RLM(**spec.endpoint_options())
    return _RUNNERS[key]


def _close_runners() -> None:
    for r in _RUNNERS.values():
        r.close()
    _RUNNERS.clear()


def ray_trial(spec: TrialSpec) -> dict:
    """The body of one Ray task: :func:`run_trial` with the worker's shared runner."""
    return run_trial(spec, runner=_worker_runner(spec))


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ConfigError: Ray is not installed (the message gives the install command).
    """
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--ray needs Ray: {install_hint('ray')}") from None
    return ray


def _env_vars(specs: list[TrialSpec]) -> dict[str, str]:
    names = {s.api_key_env for s in specs if s.base_url is not None}
    return {n: os.environ[n] for n in sorted(names) if os.environ.get(n)}


def reachable(address: str, timeout: float = 5.0) -> None:
    """A ``HOST:PORT`` address must accept a TCP connection: ``ray.init`` retries an absent
    cluster for minutes, printing warnings, instead of failing.

    Raises:
        ConfigError: nothing answers at the address within ``timeout`` seconds.
    """
    import socket
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", "ray://...": Ray resolves those itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(f"no Ray cluster answers at {address} ({exc}); start one with "
                          f"`ray start --head --port {port}` or give its address") from None


def run_on_ray(specs: list[TrialSpec], address: str) -> Iterator[dict]:
    """Run ``specs`` as Ray tasks on the cluster at ``address``; yield each trial record as
    it finishes (any order).

    Args:
        specs: the trials (their ``sample_factory`` is loaded by the workers).
        address: a Ray cluster address (``"HOST:PORT"`` of the head's GCS, ``"auto"``, or
            ``"ray://HOST:10001"`` for Ray Client).
    Raises:
        ConfigError: Ray is not installed or the cluster cannot be reached; a trial's setup
            error (the sweep stops, unfinished tasks are cancelled).
    """
    ray = import_ray()
    reachable(address)
    env = _env_vars(specs)
    try:
        ray.init(address=address, log_to_driver=False,
                 runtime_env={"env_vars": env} if env else None)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from None
    task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES)(ray_trial)
    pending = {task.remote(spec): spec for spec in specs}
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                yield _result(ray, ref, pending.pop(ref))
    finally:
        for ref in pending:
            ray.cancel(ref)  # a running trial gets KeyboardInterrupt: journaled cancelled
        ray.shutdown()


def _result(ray: Any, ref: Any, spec: TrialSpec) -> dict:
    """The record of a finished Ray task; a setup error stops the sweep, a lost worker (past
    its retries) becomes an ``error`` record."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        if isinstance(cause, RLMError):
            raise cause from None
        raise RLMError(f"trial {spec.key()} failed on Ray: {cause or exc}") from None
    except ray.exceptions.RayError as exc:  # the worker died past its retries
        from rlm.evaluation.trial import load_sample_factory
        sample = load_sample_factory(spec.sample_factory)(spec.task, spec.length, spec.seed,
                                                          spec.trial)
        return trial_record(spec, sample, None, truncated=False, wall_s=0.0, replayed=False,
                            error=WorkerLost(f"{type(exc).__name__}: {exc}"))


class WorkerLost(RLMError):
    """A Ray worker running the trial died (past its retries)."""
