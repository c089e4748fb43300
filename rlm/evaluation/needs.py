"""What a sweep needs before it runs, and pays for, its first trial: the report's plotting
library, the task data, and (without an endpoint) the embedded model's engine and weights.

Each missing piece is a :class:`~rlm.errors.ConfigError` (exit 2) carrying the command that
installs it, raised before anything is written or sent.
"""
from __future__ import annotations

from typing import Any

from rlm.errors import ConfigError, EmbeddedModelUnavailable, install_hint

__all__ = ["check_plotting", "check_needs"]


def check_plotting() -> None:
    """matplotlib (the ``eval`` extra) must import: the report's plots are drawn with it.

    Raises:
        ConfigError: it is not installed or does not import (the message gives the command).
    """
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"the report's plots need matplotlib ({exc}); "
                          f"{install_hint('eval')}") from None


def check_needs(grid: Any) -> None:
    """Everything the sweep of ``grid`` (a :class:`~rlm.evaluation.sweep.Grid`) and its report
    need is installed: matplotlib, RULER's data package for the built-in tasks (one's own
    ``sample_factory`` brings its own data), and for the embedded model xllamacpp and the
    weight packages (found, not hashed: the hash is checked when the server starts).

    Raises:
        ConfigError: something is missing; the message names the install command.
    """
    check_plotting()
    if grid.sample_factory is None:
        from rlm.evaluation.data import package_dir
        package_dir()
    if grid.base_url is None:
        import importlib.util

        from rlm.models.embedded import XLLAMACPP_INSTALL, locate_parts
        if importlib.util.find_spec("xllamacpp") is None:
            raise EmbeddedModelUnavailable(
                f"the embedded model needs xllamacpp, which is not installed: {XLLAMACPP_INSTALL}")
        locate_parts(grid.model)
