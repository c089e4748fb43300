"""The names of the embedded models (the one spelling of each; importing this costs nothing).

:data:`rlm.models.embedded.weights.MODELS` holds what each name means (files, hashes, window);
the option registry (:mod:`rlm.config.options`) and the CLI take the names from here.
"""
from __future__ import annotations

__all__ = ["DEFAULT_EMBEDDED_MODEL", "LARGE_EMBEDDED_MODEL", "EMBEDDED_MODELS"]

#: The embedded model used when no endpoint is configured and none is named.
DEFAULT_EMBEDDED_MODEL = "qwen2.5-coder-0.5b"
#: The embedded model ``--large`` selects.
LARGE_EMBEDDED_MODEL = "qwen2.5-coder-1.5b"
#: Every embedded model the CLI offers (the keys of ``rlm.models.embedded.MODELS``; a test checks).
EMBEDDED_MODELS = (DEFAULT_EMBEDDED_MODEL, LARGE_EMBEDDED_MODEL, "smollm2-135m")
