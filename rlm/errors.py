"""Errors raised by the public API and mapped to CLI exit codes.

Every error carries a message that says what happened and what to do. The CLI
maps each class to its ``exit_code`` (documented in ``rlm --help`` and docs/reference/failures.md):

====  =======================================================================
code  meaning
====  =======================================================================
0     the run completed with an answer
1     unexpected internal error (a bug: please report it)
2     bad input or options: missing/empty/binary context file, bad flag value
3     the model endpoint failed: unreachable, or still failing after retries
4     the kernel failed beyond recovery (could not start, died past restarts)
5     a budget cap ended the run (status ``budget_exceeded``)
6     replay or resume found a divergence from the journal
7     the run ended without an answer (iterations exhausted, no FINAL, or the
      model repeated itself: rlm.core.degenerate)
8     ``rlm verify`` found a violation in the journal
9     the journal failed under the run and stayed down past its retry limit
      (``JournalUnavailableError``; resume once it is back)
10    resume met an unfinished call of a tool that is not idempotent
      (``UnfinishedToolCall``: at most once; see docs/tools.md)
130   interrupted (Ctrl-C)
====  =======================================================================
"""
from __future__ import annotations

from harness.errors import (BudgetExceeded, DivergenceError, HarnessError,  # noqa: F401
                            IllegalTransition, RunActiveError, RunMismatchError)


class RLMError(Exception):
    """Base class of every error this package raises on purpose."""

    exit_code = 1


class ConfigError(RLMError):
    """Bad options or input given by the user (exit code 2)."""

    exit_code = 2


class ContextError(ConfigError):
    """The context could not be loaded: missing, empty, binary or undecodable file."""


class EmbeddedModelUnavailable(ConfigError):
    """The embedded model's extra is not installed, or its weights fail the hash check."""


class EndpointError(RLMError):
    """The model endpoint could not be reached or kept failing after retries (exit 3)."""

    exit_code = 3


class ModelReplyError(EndpointError):
    """The endpoint answered with something that is not a usable completion."""


class KernelError(RLMError):
    """A Jupyter kernel could not start, or died more times than the restart limit (exit 4)."""

    exit_code = 4


class ChildRLMError(RLMError):
    """A child RLM failed. ``status`` is the child's final status, ``reason`` why.

    Raised inside the parent's kernel so the parent's code can catch it; never
    returned as a string that looks like an answer.
    """

    def __init__(self, message: str, status: str = "failed", reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason or message


def install_hint(extra: str) -> str:
    """The command that installs the optional dependencies ``extra`` (a ``pyproject.toml``
    extra such as ``pdf``): from the checkout this package runs from, when it is one (an
    editable install: the project is not on a package index), else by the package's name."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "pyproject.toml")):
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install 'rlm-kernels[{extra}]'"


def __getattr__(name: str):
    """``JournalUnavailableError`` (exit code 9): the journal's database failed under a run past
    its bounded retries. Raised by the journal itself (``harness.journal.faults``), so the class
    is that one; looked up on first use, as the journal package is not imported with this module."""
    if name == "JournalUnavailableError":
        from harness.journal.errors import JournalUnavailableError
        return JournalUnavailableError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
