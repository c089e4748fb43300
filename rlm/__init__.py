"""Recursive language models on real Jupyter kernels.

Public API: :func:`completion`, :func:`plain_completion`, :func:`acompletion`, :class:`RLM`,
:class:`AsyncRLM`, :class:`Result`, and the errors in :mod:`rlm.errors`. The CLI is ``rlm`` (see ``rlm --help``).
"""
from harness.budget import Budget
from harness.errors import BudgetExceeded

from .aio import AsyncRLM, acompletion
from .api import RLM, Result, completion, plain_completion
from .errors import (ChildRLMError, ConfigError, ContextError, DivergenceError,
                     EmbeddedModelUnavailable, EndpointError, KernelError, ModelReplyError,
                     RLMError, RunActiveError)

__all__ = ["completion", "plain_completion", "acompletion", "RLM", "AsyncRLM", "Result", "Budget", "BudgetExceeded",
           "RLMError", "ConfigError",
           "ContextError", "EndpointError", "ModelReplyError", "KernelError", "ChildRLMError",
           "DivergenceError", "RunActiveError", "EmbeddedModelUnavailable"]
__version__ = "0.1.0"
