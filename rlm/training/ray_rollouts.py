"""Rollouts as Ray tasks (``Environment.rollouts(..., ray_address=...)``; the ``ray`` extra).

Each rollout is one Ray task (one CPU; its own kernels on the node that runs it), running
:meth:`rlm.training.env.Environment.rollout` in a worker that keeps one environment per
settings (so an embedded model server starts once per worker). The results come back in
input order. Nodes need this package and the sample factory importable. Where rollouts are
journaled: the environment's journal, so for several machines a ``postgresql://`` URL every
node reaches (a SQLite path is one file per node, and a rollout then replays on the node
that ran it). The policy, its key included, travels to the workers with each task.
"""
from __future__ import annotations

from typing import Any

from rlm.errors import ConfigError, RLMError

__all__ = ["rollouts_on_ray"]

#: Ray retries of a rollout whose worker died (the retry resumes it from the journal).
MAX_RETRIES = 2


def rollouts_on_ray(body: Any, settings: dict, jobs: list[tuple[Any, int]], policy: Any,
                    tag: str, address: str) -> list[Any]:
    """Run ``jobs`` (``(sample, attempt)`` pairs) as Ray tasks on the cluster at ``address``
    and return their :class:`~rlm.training.env.Rollout` objects in input order.

    ``body(settings, sample, policy, tag, attempt)`` is the task (a module-level function,
    which Ray ships by reference: :func:`rlm.training.env.rollout_in_worker`).

    Raises:
        ConfigError: Ray is not installed, the cluster cannot be reached, or a rollout's
            setup failed. RLMError: a task failed past its retries.
    """
    from rlm.evaluation.ray_runner import import_ray, reachable
    ray = import_ray()
    reachable(address)
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from None
    task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES)(body)
    refs = [task.remote(settings, sample, policy, tag, attempt) for sample, attempt in jobs]
    try:
        return [_get(ray, ref) for ref in refs]
    finally:
        for ref in refs:
            try:
                ray.cancel(ref)  # a failed batch stops what still runs; done tasks ignore it
            except Exception:  # noqa: BLE001 - best effort
                pass
        ray.shutdown()


def _get(ray: Any, ref: Any) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (ConfigError, RLMError)):
            raise type(cause)(str(cause)) from None
        raise RLMError(f"a rollout failed on Ray: {cause or exc}") from None
    except ray.exceptions.RayError as exc:
        raise RLMError(f"a rollout's Ray worker died: {type(exc).__name__}: {exc}") from None
