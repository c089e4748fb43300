"""Recursive language models on real Jupyter kernels.

Public API: :func:`completion`, :func:`plain_completion`, :func:`acompletion`, :class:`RLM`,
:class:`AsyncRLM`, :class:`Session`, :class:`Result`, and the errors in :mod:`rlm.errors`. The CLI is ``rlm`` (see ``rlm --help``).

Names are imported on first use (``import rlm`` itself is cheap): a run's set-up then
overlaps the cold start of its first kernel, which :func:`completion` begins before anything
heavy is imported.
"""
from __future__ import annotations

from typing import Any

__all__ = ["completion", "plain_completion", "acompletion", "RLM", "AsyncRLM", "Session", "Result", "Budget", "BudgetExceeded",
           "RLMError", "ConfigError",
           "ContextError", "EndpointError", "ModelReplyError", "KernelError", "ChildRLMError",
           "DivergenceError", "RunActiveError", "EmbeddedModelUnavailable", "tool", "Tool",
           "ToolError"]
from rlm.version import __version__  # noqa: E402,F401

# name -> the module that defines it
_LAZY = {"plain_completion": "rlm.api", "RLM": "rlm.api", "Result": "rlm.api",
         "Session": "rlm.session",
         "acompletion": "rlm.aio", "AsyncRLM": "rlm.aio",
         "Budget": "harness.budget.accountant", "BudgetExceeded": "harness.errors",
         "tool": "rlm.tools", "Tool": "rlm.tools", "ToolError": "rlm.tools",
         **{name: "rlm.errors" for name in (
             "RLMError", "ConfigError", "ContextError", "EndpointError", "ModelReplyError",
             "KernelError", "ChildRLMError", "DivergenceError", "RunActiveError",
             "EmbeddedModelUnavailable")}}


def completion(context: Any, query: str | None = None, **options: Any):
    """Run one RLM: ``context`` (str/list/dict, or ``Path``/paths/``"-"``), optional ``query``.

    Same options as :class:`RLM`; returns a :class:`Result`. An embedded model server started
    for this call is stopped before it returns. See :meth:`RLM.completion` for errors.

    The root's kernel starts first thing (:func:`kernels.pool.head_start`), so its cold
    start (~0.6 s) overlaps the imports and the set-up of the run; if the run needs no kernel
    after all (a recorded result, bad options) it is shut down.
    """
    from kernels.pool import drop_head_start, head_start

    from rlm.config.ahead import kernels_ahead, sandbox_of
    head_start(kernels_ahead(options), sandbox_of(options))
    try:
        from rlm.api import completion as run
        return run(context, query, **options)
    finally:
        drop_head_start()  # only one the run did not take


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rlm' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
