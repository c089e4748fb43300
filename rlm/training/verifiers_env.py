"""The environment as a ``verifiers`` (0.4, ``verifiers.v1``) taskset and harness, so a
prime-rl style trainer or ``vf-eval`` runs our RLM as its rollout.

``vf-eval rlm.training.verifiers_env ...`` (or ``--env.taskset.id rlm.training.verifiers_env``)
loads this module as a verifiers plugin: it exports one :class:`RLMTaskset` (the samples of
``rlm eval``'s tasks: ``--env.taskset.tasks``, ``.lengths``, ``.n``, ``.seed``,
``.sample-factory``) and one :class:`RLMHarness`, the taskset's default harness. The harness
runs its loop in-process, as verifiers allows when every model call goes through the
rollout's interception endpoint: it hands that endpoint and its token to
:meth:`rlm.training.env.Environment.rollout` as the policy, so the root's turns and every
sub-call (``sub_model`` on the same endpoint) are the policy's, recorded in the trace, while
the code runs in our sandboxed kernels under the harness's caps and the run is journaled.
With ``sub_base_url`` the sub-calls go to that endpoint instead (a fixed model beside the
policy: they are journaled, not in the trace), its key read from the environment variable
``sub_api_key_var`` names (``RLM_SUB_API_KEY``), never from a flag.
The trace's ``info["rlm"]`` holds the rollout (run id, journal, answer, usage), and the
task's reward is the eval task's own score of the answer.

Needs the ``train`` extra (``pip install 'rlm-kernels[train]'``); see docs/training.md for
what verifiers 0.4 pulls in with it.
"""
from __future__ import annotations

import asyncio
import os
import threading
import weakref
from pathlib import Path
from typing import Annotated, Any

import verifiers.v1 as vf
from pydantic import Field, field_validator
from verifiers.v1.runtimes import ProgramResult

from rlm.config.options import MAX_DEPTH_LIMIT
from rlm.prompting.prompts import PROFILES
from rlm.training.env import Environment, Policy

__all__ = ["RLMTaskset", "RLMHarness"]

# The places of the rollouts running at once, per event loop and setting: verifiers loads a
# harness object per episode, so a semaphore of one object would bound nothing.
_SLOTS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, asyncio.Semaphore]]" = (
    weakref.WeakKeyDictionary())


def _slots(concurrency: int) -> asyncio.Semaphore:
    """The semaphore of ``concurrency`` places shared by every harness in the running loop."""
    per_loop = _SLOTS.setdefault(asyncio.get_running_loop(), {})
    return per_loop.setdefault(concurrency, asyncio.Semaphore(concurrency))


class RLMTaskData(vf.TaskData):
    """One sample: where :func:`rlm.evaluation.tasks.make_sample` (or the sample factory)
    finds it. ``prompt`` is its question; the context stays out of the chat."""

    task: str
    length: int
    seed: int = 0
    index: int = 0


class RLMTask(vf.Task[RLMTaskData]):
    """A sample, rewarded by its task's scorer through the harness's rollout."""

    @vf.reward
    async def task_score(self, trace: Any) -> float:
        """The eval task's score of the RLM's answer, 0..1 (0.0 when the run did not
        complete or the harness recorded no rollout)."""
        rollout = (trace.info or {}).get("rlm") or {}
        return float(rollout.get("reward") or 0.0)


class RLMTasksetConfig(vf.TasksetConfig):
    """``--env.taskset.*``: the samples, as ``rlm eval`` names them."""

    tasks: list[str] = ["niah_single_1"]
    lengths: list[int] = [4096]
    n: int = 5
    seed: int = 0
    sample_factory: str | None = None


class RLMTaskset(vf.Taskset[RLMTask, RLMTasksetConfig]):
    """tasks x lengths x ``n`` samples (indices 0..n-1) of ``rlm eval``'s tasks."""

    def load(self):
        """Yield one :class:`RLMTask` per sample (its id ``task|length|seed|index``)."""
        from rlm.evaluation.trial import checked_sample, load_sample_factory
        make = load_sample_factory(self.config.sample_factory)
        for task in self.config.tasks:
            for length in self.config.lengths:
                for index in range(self.config.n):
                    where = (task, length, self.config.seed, index)
                    sample = checked_sample(make, where, self.config.sample_factory)
                    key = "|".join(map(str, where))
                    yield RLMTask(RLMTaskData(id=key, name=key, prompt=sample.query, task=task,
                                              length=length, seed=self.config.seed,
                                              index=index), self.config.task)


class RLMHarnessConfig(vf.HarnessConfig):
    """``--env.agent.harness.*``: the RLM's depth, profile and caps, where its sub-calls go
    (``sub_model``; ``sub_base_url``, whose key is in the variable ``sub_api_key_var``
    names), how many rollouts run at once in this process (``concurrency``), and where their
    journal goes."""

    # checked when vf-eval reads its flags, so a bad setting stops it before any rollout
    # (not as an error in every trace)
    id: str = "rlm-verifiers"
    max_depth: Annotated[int, Field(ge=0, le=MAX_DEPTH_LIMIT)] = 1
    profile: str = "small"
    sub_model: str | None = None
    sub_base_url: str | None = None
    sub_api_key_var: str = "RLM_SUB_API_KEY"
    max_calls: Annotated[int, Field(ge=1)] | None = 30
    max_tokens: Annotated[int, Field(ge=1)] | None = 200_000
    max_iterations: Annotated[int, Field(ge=1)] | None = None
    max_wall_seconds: Annotated[float, Field(gt=0)] | None = 600.0
    concurrency: Annotated[int, Field(ge=1)] = 4
    directory: str = "rlm-rollouts"
    journal: str | None = None
    sample_factory: str | None = None

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        if value not in PROFILES and not Path(value).expanduser().is_file():
            raise ValueError(f"{value!r} is neither a built-in profile ({', '.join(PROFILES)}) "
                             "nor a prompt file")
        return value


class RLMHarness(vf.Harness[RLMHarnessConfig]):
    """Runs the RLM in-process for each rollout (see the module doc)."""

    EXECUTES_CODE = True
    # the model's code runs in our own sandboxed kernels (bubblewrap), not in the runtime
    NEEDS_CONTAINER = False

    def __init__(self, config: RLMHarnessConfig) -> None:
        super().__init__(config)
        self._env: Environment | None = None
        self._lock = threading.Lock()

    def environment(self) -> Environment:
        """The :class:`Environment` of this harness's settings (made once)."""
        with self._lock:
            if self._env is None:
                c = self.config
                caps = {k: getattr(c, k) for k in ("max_calls", "max_tokens", "max_iterations",
                                                    "max_wall_seconds")
                        if getattr(c, k) is not None}
                self._env = Environment(c.directory, journal=c.journal, max_depth=c.max_depth,
                                        profile=c.profile, caps=caps,
                                        sample_factory=c.sample_factory)
            return self._env

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict, data: Any, tool_interception_url: str | None = None
                     ) -> ProgramResult:
        """One rollout: the RLM on the task's sample, its model calls through ``endpoint``
        (bearer ``secret``) as ``ctx.model``, its sub-calls there too or to ``sub_base_url``;
        ``trace.info["rlm"]`` gets the rollout."""
        c = self.config
        policy = Policy(base_url=endpoint, model=ctx.model, api_key=secret,
                        sub_model=c.sub_model, sub_base_url=c.sub_base_url,
                        sub_api_key=os.environ.get(c.sub_api_key_var) if c.sub_base_url
                        else None)
        where = (data.task, data.length, data.seed, data.index)
        # vf-eval runs up to 128 episodes at once, each with a harness of its own, and each
        # RLM run has kernels: at most `concurrency` of them run in this process
        async with _slots(self.config.concurrency):
            rollout = await asyncio.to_thread(self.environment().rollout, where, policy,
                                              tag=str(trace.id))
        trace.info["rlm"] = rollout.to_dict()
        return ProgramResult(exit_code=0, stdout=rollout.answer or "",
                             stderr=rollout.error or "")
