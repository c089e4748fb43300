"""Model prices in USD per million tokens, and the cost of a call.

Built-in figures are public *list* prices for standard (non-batch, non-cached, short-context)
text tokens. Sources and dates:

* OpenAI models: https://platform.openai.com/docs/pricing (``openai.com/api/pricing``), standard
  tier. The figures below are the list prices as published by OpenAI; cross-checked against a
  copy of that table dated March 2026 (deploybase.ai, "OpenAI pricing", 2026-03-21).
  ``o3`` is the price after OpenAI's June 2025 reduction (was $10 / $40).
* Anthropic models: https://docs.anthropic.com/en/docs/about-claude/pricing (base input and
  output tokens), as published August 2025 for Opus 4.1 / Opus 4 / Sonnet 4 / Sonnet 3.7 /
  Sonnet 3.5 / Haiku 3.5 / Haiku 3; Sonnet 4.5 ($3 / $15, Sept 2025), Haiku 4.5 ($1 / $5,
  Oct 2025) and Opus 4.5 ($5 / $25, Nov 2025) from Anthropic's launch announcements, cross-checked
  against a copy dated 2026-03-21. Sonnet 4 / 4.5 charge more above 200K input tokens
  ($6 / $22.50); the base rate is used here, so prefer the provider's reported cost when an
  endpoint returns one.

Prices change: for real money, pass a price file (:meth:`PriceTable.load`) or rely on the
provider's reported cost. Local/embedded models (names starting ``local/``, or listed in
``local_models``) cost 0 USD.

This module is pure standard library and imports nothing from ``rlm`` or ``kernels``.
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping

from harness.errors import HarnessError

__all__ = ["Price", "PriceTable", "PriceTableError", "UnknownPrice", "BUILTIN_PRICES", "FREE"]


class PriceTableError(HarnessError):
    """A price file is missing, unreadable or malformed."""

    exit_code = 2


class UnknownPrice(HarnessError):
    """A cost cap is set but some model has no price, so its spend could not be bounded."""

    exit_code = 2

    def __init__(self, models: Iterable[str], message: str | None = None) -> None:
        self.models = sorted(set(models))
        names = ", ".join(repr(m) for m in self.models)
        super().__init__(message or (
            f"no price known for model(s) {names}, and a cost cap is set. Add a price file "
            f"(JSON: {{\"<model>\": {{\"input\": <USD per 1M input tokens>, "
            f"\"output\": <USD per 1M output tokens>}}}}) and load it with "
            f"a price file (CLI: --price-file PATH; API: price_file=PATH), mark the model as local (prefix "
            f"'local/'), or drop the cost cap."))


@dataclass(frozen=True)
class Price:
    """Price of one model.

    Attributes:
        usd_per_mtok_input: USD per 1,000,000 prompt (input) tokens (float >= 0).
        usd_per_mtok_output: USD per 1,000,000 completion (output) tokens (float >= 0).
    """

    usd_per_mtok_input: float
    usd_per_mtok_output: float

    def __post_init__(self) -> None:
        for name in ("usd_per_mtok_input", "usd_per_mtok_output"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"Price.{name} must be a finite number >= 0, got {v!r}")

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """Cost in USD (float) of ``prompt_tokens`` in and ``completion_tokens`` out."""
        return (prompt_tokens * self.usd_per_mtok_input
                + completion_tokens * self.usd_per_mtok_output) / 1_000_000


FREE = Price(0.0, 0.0)

#: Built-in list prices, USD per 1M tokens (input, output). See the module docstring for sources.
BUILTIN_PRICES: dict[str, Price] = {
    # OpenAI, platform.openai.com/docs/pricing, standard tier, as of 2026-03 (see docstring).
    "gpt-4o": Price(2.50, 10.00),
    "gpt-4o-mini": Price(0.15, 0.60),
    "gpt-4.1": Price(2.00, 8.00),          # launched 2025-04-14
    "gpt-4.1-mini": Price(0.40, 1.60),
    "gpt-4.1-nano": Price(0.10, 0.40),
    "o3": Price(2.00, 8.00),               # after the 2025-06-10 price cut
    "o3-mini": Price(1.10, 4.40),
    "o4-mini": Price(1.10, 4.40),
    "gpt-5": Price(1.25, 10.00),           # launched 2025-08-07
    "gpt-5-mini": Price(0.25, 2.00),
    "gpt-5-nano": Price(0.05, 0.40),
    # Anthropic, docs.anthropic.com/en/docs/about-claude/pricing, base input/output,
    # as of 2025-08 (Sonnet 4.5 2025-09, Haiku 4.5 2025-10, Opus 4.5 2025-11; see docstring).
    # Names as Anthropic's API (and OpenAI-compatible proxies such as LiteLLM) serve them;
    # dated forms like "claude-sonnet-4-20250514" resolve to these via lookup().
    "claude-opus-4-5": Price(5.00, 25.00),
    "claude-opus-4-1": Price(15.00, 75.00),
    "claude-opus-4-0": Price(15.00, 75.00),
    "claude-opus-4": Price(15.00, 75.00),
    "claude-sonnet-4-5": Price(3.00, 15.00),
    "claude-sonnet-4-0": Price(3.00, 15.00),
    "claude-sonnet-4": Price(3.00, 15.00),
    "claude-3-7-sonnet": Price(3.00, 15.00),
    "claude-3-5-sonnet": Price(3.00, 15.00),
    "claude-haiku-4-5": Price(1.00, 5.00),
    "claude-3-5-haiku": Price(0.80, 4.00),
    "claude-3-haiku": Price(0.25, 1.25),
}

# "-2024-08-06" (OpenAI), "-20250514" (Anthropic), "-latest" (Anthropic alias).
_DATED_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8}|latest)$")
LOCAL_PREFIX = "local/"


class PriceTable:
    """Model name -> :class:`Price` (USD per 1M tokens), thread-safe.

    Args:
        prices: entries added to (and overriding) the built-in table; ``{name: Price}``.
        local_models: names of local/embedded models that cost 0 USD (besides any name starting
            with ``"local/"``).
        builtin: include :data:`BUILTIN_PRICES` (default ``True``).
    """

    def __init__(self, prices: Mapping[str, Price] | None = None, *,
                 local_models: Iterable[str] = (), builtin: bool = True) -> None:
        self._lock = threading.Lock()
        self._prices: dict[str, Price] = dict(BUILTIN_PRICES) if builtin else {}
        if prices:
            for name, p in prices.items():
                if not isinstance(p, Price):
                    raise TypeError(f"price for {name!r} must be a Price, got {type(p).__name__}")
                self._prices[name] = p
        self._local: set[str] = set(local_models)
        self._cache: dict[str, Price | None] = {}

    # ------------------------------------------------------------------ building

    def set(self, model: str, price: Price) -> None:
        """Add or override the price of ``model``."""
        with self._lock:
            self._prices[model] = price
            self._cache.clear()

    def add_local(self, *models: str) -> None:
        """Mark models as local/embedded (0 USD)."""
        with self._lock:
            self._local.update(models)
            self._cache.clear()

    def load(self, path: str | os.PathLike) -> "PriceTable":
        """Extend/override this table from a JSON file; returns ``self``.

        The file holds ``{"<model>": {"input": <USD per 1M input tokens>, "output": <USD per
        1M output tokens>}, ...}``. Keys starting with ``_`` (e.g. ``"_source"``) are ignored,
        so a file can carry its own provenance note. The whole file is validated before anything
        is changed.

        Raises:
            PriceTableError: the file is missing, unreadable, not JSON, or an entry is malformed
                (message names the file and the entry).
        """
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise PriceTableError(f"price file not found: {path}") from None
        except OSError as e:
            raise PriceTableError(f"cannot read price file {path}: {e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PriceTableError(f"price file {path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise PriceTableError(
                f"price file {path}: top level must be an object "
                f'{{"<model>": {{"input": ..., "output": ...}}}}, got {type(data).__name__}')
        parsed: dict[str, Price] = {}
        for model, entry in data.items():
            if model.startswith("_"):
                continue
            where = f"price file {path}, model {model!r}"
            if not isinstance(entry, dict):
                raise PriceTableError(f"{where}: expected an object "
                                      f'{{"input": <USD/1M>, "output": <USD/1M>}}, got {entry!r}')
            missing = [k for k in ("input", "output") if k not in entry]
            if missing:
                raise PriceTableError(f"{where}: missing key(s) {missing}")
            extra = set(entry) - {"input", "output"}
            if extra:
                raise PriceTableError(f"{where}: unknown key(s) {sorted(extra)}; "
                                      f'only "input" and "output" (USD per 1M tokens)')
            try:
                parsed[model] = Price(entry["input"], entry["output"])
            except ValueError as e:
                raise PriceTableError(f"{where}: {e}") from None
        with self._lock:
            self._prices.update(parsed)
            self._cache.clear()
        return self

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, local_models: Iterable[str] = ()) -> "PriceTable":
        """Built-in table extended/overridden by the JSON file at ``path`` (see :meth:`load`)."""
        return cls(local_models=local_models).load(path)

    # ------------------------------------------------------------------ queries

    def is_local(self, model: str) -> bool:
        """``True`` if ``model`` is a local/embedded model (0 USD)."""
        return model.startswith(LOCAL_PREFIX) or model in self._local

    def lookup(self, model: str) -> Price | None:
        """Price of ``model``, or ``None`` if unknown.

        Resolution order: local model (0 USD); exact name; without a provider prefix
        (``openai/gpt-4o`` -> ``gpt-4o``); without a dated suffix (``gpt-4o-2024-08-06`` ->
        ``gpt-4o``, ``claude-sonnet-4-20250514`` -> ``claude-sonnet-4``, ``...-latest``).
        """
        with self._lock:
            try:
                return self._cache[model]
            except KeyError:
                pass
            p = self._resolve(model)
            self._cache[model] = p
            return p

    def _resolve(self, model: str) -> Price | None:
        if self.is_local(model):
            return FREE
        candidates = [model]
        if "/" in model:
            candidates.append(model.rsplit("/", 1)[1])
        for name in list(candidates):
            stripped = _DATED_SUFFIX.sub("", name)
            if stripped != name:
                candidates.append(stripped)
        for name in candidates:
            p = self._prices.get(name)
            if p is not None:
                return p
        return None

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and self.lookup(model) is not None

    def models(self) -> dict[str, Price]:
        """A copy of the explicit entries (built-in plus loaded), ``{name: Price}``."""
        with self._lock:
            return dict(self._prices)

    def cost(self, model: str, prompt_tokens: int, completion_tokens: int) -> float:
        """Cost in USD (float) of one call.

        Raises:
            UnknownPrice: no price for ``model``.
        """
        p = self.lookup(model)
        if p is None:
            raise UnknownPrice([model])
        return p.cost(prompt_tokens, completion_tokens)
