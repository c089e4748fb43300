"""Run options: the one registry of every option (:data:`OPTIONS`) and the :class:`Options` a run
tree is driven with.

Every keyword option of :func:`rlm.completion`, :class:`rlm.RLM` and :func:`rlm.api.resume` is
declared once, as an :class:`Option` in :data:`OPTIONS`: its keyword name, CLI flag, type,
default (and the embedded model's default), allowed range or choices, help text, reference text,
which ``rlm`` commands take it, whether the journal keeps it for resume/replay, and which
:class:`harness.budget.accountant.Budget` field it feeds. Everything else is derived from that tuple:

==========================================  =================================================
:data:`OPTION_NAMES`, :func:`check_names`   the accepted keyword names
:func:`rlm.config.validate.validate_options` range/choice/URL checks naming the flag
:func:`endpoint_configured`                 "is an endpoint configured?" (options, else env)
:func:`external_endpoint`                   that endpoint resolved (URL, key, model), or None
:func:`rlm.config.flags.add_arguments`      the argparse flags of one ``rlm`` command
:func:`rlm.config.flags.options_from_args`  parsed flags -> keyword options
:mod:`rlm.config.build`                     keyword options -> :class:`Options`; the journal
                                            record of a run's options and its way back
``docs/reference/options.md``               the generated reference (a test checks it)
==========================================  =================================================

Adding an option: one :class:`Option` entry here (then ``python scripts/gen_reference.py``
rewrites the docs reference), and if the loop reads it one :class:`Options` attribute of the same
name. A cap is also one entry of the cap table, :data:`harness.budget.caps.CAPS`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping

from harness.budget.accountant import Budget
from harness.budget.prices import PriceTable
from kernels.bwrap import MODES as SANDBOX_MODES

from rlm.config.endpoint import (Endpoint, endpoint_configured,  # noqa: F401  (re-exported)
                                 external_endpoint)
from rlm.config.checks import (context_window, http_url, patterns, placement, price_file,
                                prompt_profile, run_id, sub_http_url)
from rlm.errors import ConfigError
from rlm.models.base import DEFAULT_PROVIDER, PROVIDERS
from rlm.models.catalog import (DEFAULT_EMBEDDED_MODEL, EMBEDDED_MODELS,  # noqa: F401  (re-exported)
                                LARGE_EMBEDDED_MODEL)


@dataclass
class Options:
    """Everything a run needs to know besides its context and query.

    Attributes (units in brackets):
        model: the root model's name; ``child_model`` for child roots and
            ``sub_model`` for ``llm_query``/fallbacks default to it.
        base_url, api_key: the endpoint; None means the embedded model.
        sub_base_url, sub_api_key: a separate endpoint for ``llm_query``(``_batched``) and
            fallbacks, and its key (None: they go to ``base_url``, as children always do).
        provider: the endpoint's API (a name in :data:`rlm.models.base.PROVIDERS`).
        cell_timeout: [s] per executed block; the kernel is interrupted after it.
        max_output_chars: [characters] of cell output fed back per turn.
        context_window: [tokens] the model's window for compaction (None: the embedded
            server's or the table's; 0: compaction off); compact_at: [share] of it.
        max_completion_tokens: [tokens] output cap of root/child turns.
        sub_max_tokens: [tokens] output cap of ``llm_query`` and fallbacks.
        budget: every cap, and the one place each lives: cost, tokens, calls, wall seconds,
            concurrency, children per call, iterations per loop (``budget.max_iterations``)
            and depth (``budget.max_depth``, see docs/depth.md).
        pool_size: idle pre-started kernels (None: 0 at depth <= 1, else 2).
        max_kernel_restarts: restarts of one instance's kernel before it fails.
        divergence: ``"stop"`` (default) or ``"live"``: what resume does when a
            recorded call's request differs from the new one.

    Settings only: the journal, the stage listeners, the progress callback and the cancel
    handle are live objects of the caller, handed to the run as :class:`rlm.core.hooks.RunHooks`.
    The keyword options that fill these attributes, with their units, ranges and CLI flags, are
    declared in :data:`OPTIONS` (:func:`rlm.config.build.build_options`); the defaults here are the registry's
    (``tests/test_options.py`` checks), so an ``Options()`` built by hand runs like the API.
    """

    model: str = "scripted"
    sub_model: str | None = None
    child_model: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    sub_base_url: str | None = None
    sub_api_key: str | None = field(default=None, repr=False)
    provider: str = DEFAULT_PROVIDER
    cell_timeout: float = 60.0
    max_output_chars: int = 4000
    context_window: int | None = None  # tokens; None: known or none, 0: no compaction
    compact_at: float = 0.8  # share of the window (rlm.core.compaction)
    max_completion_tokens: int = 1024
    sub_max_tokens: int = 512
    sub_prompt_chars: int = 6000
    temperature: float | None = 0.0
    budget: Budget = field(default_factory=Budget)
    prices: PriceTable | None = None
    price_file: str | None = None
    pool_size: int | None = None
    sandbox: str | None = None
    kernel_network: bool = False
    kernel_memory_mb: int = 4096
    kernel_processes: int = 1024
    kernel_disk_mb: int = 1024
    kernel_seed: int = 0
    kernels: str = "local"  # where kernels run (kernels.provider.parse_placement)
    gateway_url: str | None = None  # else $JUPYTER_GATEWAY_URL; the token only from the env
    gateway_kernelspec: str = "rlm"
    max_kernel_restarts: int = 3
    max_attempts: int = 6
    divergence: str = "stop"
    embedded: bool = False
    system_template: str | None = None
    prompt: str = "general"
    # embedding (rlm.core.schema): what FINAL must pass
    answer_schema: dict | None = None
    verify: Callable[[Any], Any] | None = None
    tools: tuple = ()  # the user's host tools (rlm.tools.Tool), one call's limit [s]:
    tool_timeout: float = 30.0
    max_tool_bytes: int = 1 << 20  # [bytes] of one tool call's arguments, and of its result



#: The deepest tree a run may ask for: each level holds kernels (about 60 MB each) while
#: its children run, so a runaway recursion is refused before it exhausts memory.
MAX_DEPTH_LIMIT = 8

#: ``Option.group`` values and the titles of their argparse groups. ``None`` (no group): the
#: flag sits with the command's own flags.
ENDPOINT = "endpoint"
LIMITS = "limits"
SANDBOX = "sandbox"
GROUP_TITLES = {ENDPOINT: "model endpoint (default: the embedded local model)",
                LIMITS: "loop, depth and budget",
                SANDBOX: "kernel sandbox (see docs/security.md)"}

#: ``rlm`` commands whose flags come (partly) from the registry (``Option.commands``).
RUN, RESUME, REPLAY, SERVE = "run", "resume", "replay", "serve"
#: ``rlm chat`` (a session): every ``rlm run`` option but ``--run-id``, and the session caps.
CHAT = "chat"
JOURNAL_COMMANDS = (RUN, RESUME, REPLAY, SERVE, "show", "runs", "export", "verify")


@dataclass(frozen=True)
class Switch:
    """A flag without a value that sets its option to a fixed value (``--large``, ``--no-journal``).

    Attributes:
        flag: the CLI flag (str, e.g. ``"--large"``).
        value: what the option becomes when the flag is given; it wins over the option's own flag.
        help: argparse help text (str).
        commands: the ``rlm`` commands that take it (tuple of str).
    """

    flag: str
    value: Any
    help: str
    commands: tuple[str, ...] = (RUN,)

    @property
    def dest(self) -> str:
        """The argparse attribute name (str): the flag without dashes, ``-`` as ``_``."""
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Option:
    """One keyword option, declared once; see :data:`OPTIONS`.

    Attributes:
        name: the Python keyword (str); also the :class:`Options` attribute it is copied to when
            :class:`Options` has one of that name (see :attr:`to_options`).
        flag: the CLI flag (str, e.g. ``"--max-cost"``) or None for a Python-only option.
        type: the value's type (``int``, ``float``, ``str``, or ``object`` for anything else);
            ``int``/``float`` flags are parsed as such, ``int`` values must be whole numbers.
        default: the value a run uses when the option is not given (None: none/unset).
        embedded_default: the default when the embedded model serves the run, if it differs.
        min, max: the allowed range (inclusive; both or neither). Only options with a range are
            checked as numbers.
        min_exclusive: True if the value must be strictly greater than ``min``.
        choices: the allowed values (tuple) or None.
        metavar: the value's placeholder in docs and ``--help`` (``--help`` lists ``choices``
            instead when there are some).
        help: the argparse help text (str).
        doc: the one-line meaning in the options reference (markdown; str).
        doc_default: the default as the options reference states it, when the value alone does not say it.
        group: :data:`ENDPOINT`, :data:`LIMITS` or None: the argparse group of the flag. Endpoint
            options are not carried over when a run recorded on the embedded model is resumed.
        commands: the ``rlm`` commands whose parser takes the flag (tuple of str).
        stored: True if the journal keeps it so ``rlm resume``/``rlm replay`` rebuild the same
            run: in the record's top level when :class:`Options` has the attribute, else in the
            record's ``budget`` (under ``budget_field``).
        budget_field: the :class:`harness.budget.accountant.Budget` field it feeds (str) or None.
        switches: value-less flags that set this option (tuple of :class:`Switch`).
        empty_is_unset: True if the CLI treats an empty value (``--journal ""``) as not given.
        repeat: True if the flag may be given several times (its values form a list).
        check: an extra test of a given value: returns None if fine, else the end of the error
            message (``"must not be empty"``), prefixed with the flag.
    """

    name: str
    flag: str | None
    type: type = str
    default: Any = None
    embedded_default: Any = None
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    choices: tuple | None = None
    metavar: str | None = None
    help: str = ""
    doc: str = ""
    doc_default: str | None = None
    group: str | None = None
    commands: tuple[str, ...] = ()
    stored: bool = False
    budget_field: str | None = None
    switches: tuple[Switch, ...] = ()
    empty_is_unset: bool = False
    repeat: bool = False
    check: Callable[[Any], str | None] | None = None

    @property
    def has_attribute(self) -> bool:
        """True if :class:`Options` has an attribute of this name (the journal record keeps a
        ``stored`` option under its name then, else under its ``budget_field``)."""
        return self.name in _FIELDS

    @property
    def to_options(self) -> bool:
        """True if :func:`rlm.config.build.build_options` copies the value (or default) into the
        :class:`Options` attribute of the same name; it resolves the endpoint and journal ones."""
        return self.name in _FIELDS and self.name not in _RESOLVED

    @property
    def label(self) -> str:
        """How error messages name the option (str): its ``rlm run`` flag, else its keyword."""
        return self.flag if self.flag and RUN in self.commands else self.name

    def default_for(self, embedded: bool) -> Any:
        """The default (Any) for a run served by the embedded model (``embedded``) or not."""
        if embedded and self.embedded_default is not None:
            return self.embedded_default
        return self.default


_RUN_RESUME = (RUN, RESUME)

#: Every keyword option, each declared once. The order is the order of ``--help`` within each
#: group and of the reference tables. Embedded defaults keep what the small local model is fed small
#: (its window is 16k tokens per request) and its sub-call answers short (a rambling one costs ~25 s
#: at 512 tokens); it repeats itself when stuck, hence fewer iterations.
OPTIONS: tuple[Option, ...] = (
    # -- the context (--context itself is the CLI's: rlm/cli/main.py) -------------------------------
    Option("encoding", "--encoding", metavar="NAME", commands=(RUN, RESUME, REPLAY),
           empty_is_unset=True, doc_default="detected",
           help="text encoding of the context files (default: UTF-8, else detected with "
                "charset-normalizer and noted for the model; resume and replay default to the "
                "one the run was recorded with)",
           doc="text encoding of the context files; by default UTF-8, else detected "
               "(`charset-normalizer`) and noted for the model; a given one is strict"),
    Option("include", "--include", object, metavar="PATTERN", commands=(RUN,), repeat=True,
           check=patterns,
           help="with a directory/glob: load only paths matching this gitignore-style pattern "
                "('*.py', 'docs/'); repeatable",
           doc="load only paths matching a gitignore-style pattern (`'*.py'`, `'docs/'`); "
               "repeatable (a list in Python)", doc_default="all files"),
    Option("exclude", "--exclude", object, metavar="PATTERN", commands=(RUN,), repeat=True,
           check=patterns,
           help="with a directory/glob: leave out paths matching this pattern; repeatable",
           doc="leave out paths matching the pattern; repeatable"),
    Option("max_context_bytes", "--max-context-bytes", int, min=1, max=2**40, metavar="N",
           commands=(RUN,), doc_default="2,000,000,000",
           help="cap on the context's text, per file and in total (default 2000000000); over "
                "it, the error names the biggest files",
           doc="cap on the context's text (UTF-8 bytes, after decompression), per file and in "
               "total; over it, the error names the biggest files"),
    # -- the model endpoint ------------------------------------------------------------------
    Option("model", "--model", metavar="NAME", group=ENDPOINT, commands=_RUN_RESUME, stored=True,
           help="root model name (env RLM_MODEL)",
           doc="root model (env `RLM_MODEL`)", doc_default="embedded model"),
    Option("provider", "--provider", default=DEFAULT_PROVIDER, choices=tuple(PROVIDERS),
           metavar="NAME", group=ENDPOINT, commands=_RUN_RESUME, stored=True,
           help="the endpoint's API (default openai; anthropic reads ANTHROPIC_BASE_URL/_API_KEY)",
           doc="`openai` (chat completions) or `anthropic` (Messages; env `ANTHROPIC_*`)"),
    Option("base_url", "--base-url", metavar="URL", group=ENDPOINT, commands=_RUN_RESUME,
           stored=True, check=http_url,
           help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (env OPENAI_BASE_URL)",
           doc="OpenAI-compatible endpoint (env `OPENAI_BASE_URL`)", doc_default="embedded server"),
    Option("api_key", "--api-key", metavar="KEY", group=ENDPOINT, commands=_RUN_RESUME,
           help="API key (env OPENAI_API_KEY, preferred: a flag's value is hidden from the "
                "process list only once read)",
           doc="API key (env `OPENAI_API_KEY`, preferred: the flag's value is overwritten in "
               "the command line once read); never journaled, never seen by kernels"),
    Option("sub_model", "--sub-model", metavar="NAME", group=ENDPOINT, commands=_RUN_RESUME,
           stored=True, help="model for llm_query and depth-limit fallbacks (default: --model)",
           doc="model for `llm_query` and depth-limit fallbacks", doc_default="`--model`"),
    Option("sub_base_url", "--sub-base-url", metavar="URL", group=ENDPOINT, commands=_RUN_RESUME,
           stored=True, check=sub_http_url, doc_default="`--base-url`",
           help="another OpenAI-compatible base URL for llm_query(_batched) and depth-limit "
                "fallbacks (default: --base-url, which children keep); key: env RLM_SUB_API_KEY",
           doc="another OpenAI-compatible endpoint for `llm_query`(`_batched`) and depth-limit "
               "fallbacks (children keep `--base-url`); key: env `RLM_SUB_API_KEY`, no flag"),
    Option("sub_api_key", None, group=ENDPOINT, doc_default="`$RLM_SUB_API_KEY`", doc="the key "
           "of `sub_base_url` (else env `RLM_SUB_API_KEY`); never journaled nor seen by kernels"),
    Option("child_model", "--child-model", metavar="NAME", group=ENDPOINT, commands=_RUN_RESUME,
           stored=True, help="model driving child RLMs (default: --model)",
           doc="model driving child RLMs", doc_default="`--model`"),
    Option("embedded_model", "--embedded-model", default=DEFAULT_EMBEDDED_MODEL,
           choices=EMBEDDED_MODELS, metavar="NAME", group=ENDPOINT, commands=_RUN_RESUME,
           switches=(Switch("--large", LARGE_EMBEDDED_MODEL,
                            "use the embedded 1.5B model (same as --embedded-model "
                            f"{LARGE_EMBEDDED_MODEL})", _RUN_RESUME + (SERVE,)),),
           help=f"embedded model when no endpoint is set (default {DEFAULT_EMBEDDED_MODEL})",
           doc=f"local model without an endpoint: `{LARGE_EMBEDDED_MODEL}` (`--large`) or "
               f"`{EMBEDDED_MODELS[2]}`"),
    Option("embedded_threads", "--embedded-threads", int, min=1, max=1024, metavar="N",
           group=ENDPOINT, commands=_RUN_RESUME,
           help="compute threads of the embedded llama.cpp server (default: the usable CPU "
                "cores minus one, so kernels keep a core; all of them on a 1-core machine)",
           doc="compute threads of the embedded llama.cpp server (prefill and decode); one core "
               "is left to the kernels, whose work otherwise slows decode several times over",
           doc_default="cores − 1"),
    Option("embedded_slots", None, int, min=1, max=64,
           doc="request slots of the embedded llama.cpp server, each with its own window "
               "(`rlm eval` gives one per concurrent trial)", doc_default="2"),
    Option("max_attempts", "--max-attempts", int, 6, min=1, max=100, metavar="N", group=ENDPOINT,
           commands=_RUN_RESUME,
           help="HTTP attempts per model call, first included, for 429/5xx/timeouts/connection "
                "errors (default 6; exponential backoff with jitter)",
           doc="HTTP attempts per model call (429, 5xx, timeouts, connection errors)"),
    # -- loop, depth and budget --------------------------------------------------------------
    Option("max_iterations", "--max-iterations", int, 20, embedded_default=6, min=1, max=10_000,
           metavar="N", group=LIMITS, commands=(RUN,), stored=True, budget_field="max_iterations",
           help="turns per RLM loop before a last-turn prompt (default 20; 6 with the embedded "
                "model, which repeats itself when stuck)",
           doc="turns per loop before the last-turn prompt"),
    Option("max_depth", "--max-depth", int, 1, min=0, max=MAX_DEPTH_LIMIT, metavar="N",
           group=LIMITS, commands=(RUN,), stored=True, budget_field="max_depth",
           help="kernel-bearing levels: 0 no sub-calls, 1 rlm() is a plain completion (default), "
                "d>1 children get kernels while level+1 < d",
           doc=f"0 to {MAX_DEPTH_LIMIT}; see [Depth](#depth)"),
    Option("cell_timeout", "--cell-timeout", float, 60.0, min=0, min_exclusive=True, max=86_400,
           metavar="S", group=LIMITS, commands=(RUN,), stored=True,
           help="seconds per executed code block before the kernel is interrupted, not "
                "counting the time it waits on its sub-calls (default 60)",
           doc="seconds per code block before the kernel is interrupted (time spent waiting "
               "on its sub-calls not counted)"),
    Option("max_output_chars", "--max-output-chars", int, 4000, embedded_default=2000, min=100,
           max=10_000_000, metavar="N", group=LIMITS, commands=(RUN,), stored=True,
           help="characters of cell output shown to the model per turn (default 4000; 2000 with "
                "the embedded model)",
           doc="cell output shown to the model per block (characters)"),
    Option("context_window", "--context-window", int, min=0, max=10**9, metavar="TOKENS",
           group=LIMITS, commands=(RUN,), stored=True, doc_default="known or none",
           check=context_window,
           switches=(Switch("--no-compaction", 0, "never compact (same as --context-window 0)"),),
           help="the model's window in tokens, for compaction (default: the embedded server's "
                "or the table's; 0: off)",
           doc="the model's window (tokens) for [compaction](../compaction.md), overriding the "
               "embedded server's and the hosted-model table's; `0`: off"),
    Option("compact_at", "--compact-at", float, 0.8, min=0, min_exclusive=True, max=1.0,
           metavar="SHARE", group=LIMITS, commands=(RUN,), stored=True,
           help="compact when a request would pass this share of the window (default 0.8)",
           doc="share of the window past which older turns are replaced by a summary"),
    Option("max_cost_usd", "--max-cost", float, min=0, min_exclusive=True, max=1e9, metavar="USD",
           group=LIMITS, commands=(RUN,), stored=True, budget_field="max_cost_usd",
           help="cost cap for the whole run tree, in USD",
           doc="cost cap for the whole tree (needs a price for every model)"),
    Option("max_tokens", "--max-tokens", int, min=1, max=10**15, metavar="N", group=LIMITS,
           commands=(RUN,), stored=True, budget_field="max_tokens",
           help="token cap (prompt + completion) for the whole run tree",
           doc="token cap (prompt + completion) for the whole tree"),
    Option("max_calls", "--max-calls", int, min=1, max=10**12, metavar="N", group=LIMITS,
           commands=(RUN,), stored=True, budget_field="max_calls",
           help="cap on model calls for the whole run tree",
           doc="model-call cap for the whole tree"),
    Option("max_wall_seconds", "--timeout", float, min=0, min_exclusive=True, max=10**9,
           metavar="S", group=LIMITS, commands=(RUN,), stored=True, budget_field="max_wall_seconds",
           help="wall-clock cap for the run, in seconds",
           doc="wall-clock cap in seconds; in-flight calls and cells are cut at it"),
    Option("max_children_per_call", "--max-children", int, min=1, max=10**6, metavar="N",
           group=LIMITS, commands=(RUN,), stored=True, budget_field="max_children_per_call",
           help="cap on items one batched call may start",
           doc="items one batched call may start"),
    Option("max_concurrency", "--concurrency", int, 8, min=1, max=1024, metavar="N", group=LIMITS,
           commands=(RUN,), stored=True, budget_field="max_concurrency",
           help="model calls in flight at once, and child RLMs running at once (default 8)",
           doc="model calls in flight at once, and child RLMs running at once"),
    Option("max_tool_calls", "--max-tool-calls", int, min=0, max=10**12, metavar="N",
           group=LIMITS, commands=(RUN,), stored=True, budget_field="max_tool_calls",
           help="cap on calls of the user's tools (--tool)", doc="cap on tool calls (tree)"),
    Option("pool_size", "--pool-size", int, min=0, max=64, metavar="N", group=LIMITS,
           commands=(RUN,),
           help="pre-started idle kernels for children (default 0 at depth <= 1, else 2)",
           doc="idle pre-started kernels for children", doc_default="0 / 2"),
    Option("sandbox", "--sandbox", choices=SANDBOX_MODES, metavar="MODE",
           group=SANDBOX, commands=_RUN_RESUME, stored=True,
           help="kernel sandbox: auto (default: bubblewrap where it works, else a warning), "
                "required (refuse to start a kernel without it, exit 4) or none "
                "(env RLM_SANDBOX)",
           doc="kernel sandbox: `auto`, `required` or `none` (env `RLM_SANDBOX`)",
           doc_default="`auto`"),
    Option("kernels", "--kernels", str, "local", metavar="PLACE", group=SANDBOX,
           commands=_RUN_RESUME, stored=True, check=placement,
           help="where kernels run: local (default), gateway (a Jupyter gateway, "
                "--gateway-url), or per role, e.g. root=local,children=gateway",
           doc="where kernels run: `local`, `gateway`, or `root=...,children=...` "
               "(see docs/remote-kernels.md)"),
    Option("gateway_url", "--gateway-url", str, metavar="URL", group=SANDBOX,
           commands=_RUN_RESUME, stored=True, check=http_url,
           help="the Jupyter gateway's URL (env JUPYTER_GATEWAY_URL); its token only from "
                "env JUPYTER_GATEWAY_AUTH_TOKEN",
           doc="a Jupyter gateway's URL (env `JUPYTER_GATEWAY_URL`; the token from "
               "`JUPYTER_GATEWAY_AUTH_TOKEN`, never a flag)"),
    Option("gateway_kernelspec", "--gateway-kernelspec", str, "rlm", metavar="NAME",
           group=SANDBOX, commands=_RUN_RESUME, stored=True,
           help="the kernelspec gateway kernels start (default rlm: `rlm gateway-kernelspec "
                "install` on the gateway host)",
           doc="the kernelspec gateway kernels start"),
    Option("kernel_network", "--kernel-network", bool, False, group=SANDBOX,
           commands=_RUN_RESUME, stored=True,
           help="let sandboxed kernels reach the network (default: none at all)",
           doc="sandboxed kernels keep the network"),
    Option("kernel_memory_mb", "--kernel-memory", int, 4096, min=256, max=1_048_576,
           metavar="MB", group=SANDBOX, commands=_RUN_RESUME, stored=True,
           help="memory of a sandboxed kernel, all its processes together, and the address "
                "space of each, MiB (default 4096)",
           doc="memory of a sandboxed kernel, all its processes together where its control "
               "group holds, and each process's address space (MiB)"),
    Option("kernel_processes", "--kernel-processes", int, 1024, min=16, max=1_000_000,
           metavar="N", group=SANDBOX, commands=_RUN_RESUME, stored=True,
           help="processes and threads of a sandboxed kernel, all together (default 1024)",
           doc="processes and threads of a sandboxed kernel"),
    Option("kernel_disk_mb", "--kernel-disk", int, 1024, min=16, max=1_048_576, metavar="MB",
           group=SANDBOX, commands=_RUN_RESUME, stored=True,
           help="private /tmp and home, and /dev/shm, of a sandboxed kernel, each, and its "
                "largest file, MiB (default 1024)",
           doc="private `/tmp` and home, and `/dev/shm`, of a sandboxed kernel, each, and its "
               "largest file (MiB)"),
    Option("kernel_seed", "--kernel-seed", int, 0, min=0, max=4_294_967_295, metavar="N",
           group=SANDBOX, commands=(RUN,), stored=True,
           help="seed of every kernel's chance: its hash seed (set order), random and NumPy; "
                "recorded with the run, so resume and replay use it (default 0)",
           doc="seed of every kernel's chance (hash seed, `random`, NumPy); recorded with the "
               "run for resume and replay"),
    Option("price_file", "--price-file", metavar="PATH", group=LIMITS, commands=_RUN_RESUME,
           stored=True, check=price_file,
           help='JSON prices {"model": {"input": USD/1M, "output": USD/1M}}; its path is '
                "recorded with the run, so resume reads it again (give it to resume if it moved)",
           doc='JSON `{"model": {"input": USD/1M, "output": USD/1M}}`; its absolute path is '
               "recorded, and resume reads it again", doc_default="built-in"),
    Option("tools", "--tool", object, (), metavar="MODULE:FUNCTION", commands=_RUN_RESUME,
           repeat=True, doc_default="none", help="a host function the model's code may call "
           "(module:function); repeatable; see docs/tools.md", doc="host functions the kernel "
           "may call (functions, `rlm.tool`s, `module:function`); see [Tools](../tools.md)"),
    Option("tool_timeout", "--tool-timeout", float, 30.0, min=0, min_exclusive=True,
           max=86_400, metavar="S", commands=(RUN,), stored=True, help="seconds one tool call "
           "may take (default 30)", doc="seconds one tool call may take, then `ToolError`"),
    Option("max_tool_bytes", "--max-tool-bytes", int, 1 << 20, min=1, max=1 << 30, metavar="N",
           commands=(RUN,), stored=True, help="bytes (as JSON) one tool call's arguments, and "
           "its result, may take (default 1048576)", doc="bytes (as JSON) one tool call's "
           "arguments, and its result, may take; past it the cell gets `ToolError` and the "
           "journal keeps only the sizes"),
    # -- which run, where it is recorded -----------------------------------------------------
    Option("run_id", "--run-id", metavar="ID", commands=(RUN,), empty_is_unset=True,
           check=run_id,
           help="name the run; an id that finished returns the recorded result, a crashed or "
                "failed one is resumed",
           doc="a finished id returns the recorded result; a crashed or failed one resumes",
           doc_default="new id"),
    Option("divergence", "--on-divergence", default="stop", choices=("stop", "live"),
           commands=(RESUME,),
           help="a recorded call whose request differs: stop with a report (default) or go live "
                "from that point",
           doc="a resumed call whose request differs from the journal: `stop` with a report, or "
               "go `live` from there (`rlm resume --on-divergence`)"),
    Option("journal", "--journal", object, metavar="PATH|URL", commands=JOURNAL_COMMANDS,
           empty_is_unset=True, switches=(Switch("--no-journal", False, "do not write a journal",
                                            (RUN, SERVE)),),
           help="journal: a SQLite file or a postgresql:// URL (env RLM_JOURNAL)",
           doc="journal: a SQLite file (a path) or a `postgresql://` URL, or `False` for none",
           doc_default="see below"),
    Option("journal_durability", "--journal-durability", choices=("process", "power"),
           metavar="LEVEL", commands=(RUN, RESUME, SERVE),
           help="what a journaled record survives: process (default: a crash or kill of this "
                "process) or power (also an OS crash or power loss: an fsync per commit, "
                "slower) (env RLM_JOURNAL_DURABILITY)",
           doc="what a committed journal record survives: `process` (a crash or kill of the "
               "process) or `power` (also an OS crash or power loss; an fsync per commit)",
           doc_default="process"),
    # -- Python only ---------------------------------------------------------------------------
    Option("max_completion_tokens", None, int, 1024, min=1, max=1_000_000, stored=True,
           doc="output cap of root and child turns (tokens)"),
    Option("sub_max_tokens", None, int, 512, embedded_default=256, min=1, max=1_000_000,
           stored=True, doc="output cap of `llm_query` calls and depth-limit fallbacks (tokens)"),
    Option("sub_prompt_chars", None, int, 6000, embedded_default=4000, min=100, max=10_000_000,
           stored=True, doc="prompt size the system prompt tells the model to keep `llm_query` "
                            "under (characters)"),
    Option("prompt", "--prompt", str, "general", embedded_default="small",
           metavar="PROFILE", commands=(RUN,), stored=True, check=prompt_profile,
           help="system prompt profile: 'small' (two worked programs small models copy, a "
                "lookup and a count with code; default on the embedded model), 'small-count' "
                "(an earlier layout with counting first, kept for comparison), 'general' (a way of "
                "working for capable hosted models; the default with an endpoint), or a "
                "template file's path",
           doc="system prompt profile: `small` (two worked programs for small models: a "
               "lookup, and counting with `re`), `small-count` (an earlier layout with "
               "counting first, kept for comparison), "
               "`general` (inspect, search, map with batched sub-calls, reduce in code, check), "
               "or a template file using the fields `{meta}`, `{sub_chars}`, `{max_output}`, "
               "`{rlm_line}`, `{kernel_line}`, `{tools_line}`, `{to_text}` (`{{`/`}}`: braces)",
           doc_default="`general`; `small` on the embedded model"),
    Option("temperature", None, float, 0.0, min=0.0, max=2.0, stored=True,
           doc="sampling temperature of every model call"),
    Option("max_kernel_restarts", None, int, 3, min=0, max=100, stored=True,
           doc="restarts of one RLM's kernel before that RLM fails"),
    Option("system_template", None, stored=True, doc_default="built-in",
           doc="system prompt template text replacing the `prompt` profile's (same `{fields}`)"),
    Option("on_progress", None, object,
           doc="callable taking one progress line (str); the CLI prints them unless `-q`"),
    Option("listeners", None, list,
           doc="extra stage-tree listeners (callables taking one event dict), after the "
               "journal's: the live view and the OpenTelemetry exporter use it"),
    Option("answer_schema", "--answer-schema", object, metavar="FILE.json", commands=(RUN,),
           stored=True, empty_is_unset=True,
           help="JSON Schema file the FINAL value must validate against; an invalid value is "
                "refused and the model told why",
           doc="JSON Schema the FINAL value must match (a dict, a JSON file, a dataclass or a "
               "pydantic model); see [Embedding](#embedding)"),
    Option("verify", None, object,
           doc="callable gate on the FINAL value: True/None accepts, False or a reason refuses"),
    Option("cancel", None, object,
           doc="a `rlm.aio.CancelToken`: cancelling it ends the run (kernels shut down, "
               "journaled `cancelled`, resumable)"),
    # -- sessions (rlm.session): caps over all of a session's questions ---------------------
    Option("session_max_cost_usd", "--session-max-cost", float, min=0, min_exclusive=True,
           max=1e9, metavar="USD", group=LIMITS, commands=(CHAT,),
           help="cost cap over all the questions of the session, in USD",
           doc="a session's cost cap over all its questions (USD)"),
    Option("session_max_tokens", "--session-max-tokens", int, min=1, max=10**15, metavar="N",
           group=LIMITS, commands=(CHAT,),
           help="token cap (prompt + completion) over all the questions of the session",
           doc="a session's token cap over all its questions"),
    Option("session_max_calls", "--session-max-calls", int, min=1, max=10**12, metavar="N",
           group=LIMITS, commands=(CHAT,),
           help="cap on model calls over all the questions of the session",
           doc="a session's model-call cap over all its questions"),
)

#: The options ``rlm serve`` takes as the defaults of its runs: its flags come from these entries,
#: so each has the same name, type, range and help as in ``rlm run``. ``api_key`` is not among
#: them: ``rlm serve --api-key`` is the key its clients must send, and the upstream endpoint's key
#: is serve's own ``--upstream-api-key`` (the sub-call endpoint's, ``$RLM_SUB_API_KEY``).
SERVE_OPTIONS = ("provider", "model", "base_url", "sub_model", "sub_base_url", "child_model",
                 "embedded_model", "embedded_threads", "max_attempts", "max_iterations",
                 "max_depth", "cell_timeout", "max_output_chars", "max_cost_usd", "max_tokens",
                 "max_calls", "max_wall_seconds", "max_children_per_call", "max_concurrency",
                 "price_file", "sandbox", "kernel_network", "kernel_memory_mb", "kernel_processes",
                 "kernel_disk_mb", "tools", "max_tool_calls", "tool_timeout", "max_tool_bytes",
                 "context_window", "compact_at", "kernel_seed", "pool_size", "prompt", "kernels",
                 "gateway_url", "gateway_kernelspec")
#: The options of ``rlm run`` that ``rlm serve`` does not take, and why (tests/config checks
#: that every other run option is a serve option).
NOT_SERVED = {
    "api_key": "serve's --api-key is its clients' key; the endpoint's is --upstream-api-key",
    "answer_schema": "a request's response_format gives its run's schema",
    "run_id": "a request's Idempotency-Key names its run",
    "encoding": "contexts come in the request body, as text or JSON",
    "include": "contexts come in the request body, not from directories",
    "exclude": "contexts come in the request body, not from directories",
    "max_context_bytes": "a request's size is capped by --max-body-bytes",
}
OPTIONS = tuple(replace(o, commands=o.commands + (SERVE,), switches=tuple(
                    replace(w, commands=w.commands + (SERVE,))
                    if RUN in w.commands and SERVE not in w.commands else w for w in o.switches))
                if o.name in SERVE_OPTIONS else o for o in OPTIONS)
OPTIONS = tuple(replace(o, commands=o.commands + (CHAT,), switches=tuple(
                    replace(w, commands=w.commands + (CHAT,)) if RUN in w.commands else w
                    for w in o.switches))
                if RUN in o.commands and o.name != "run_id" else o for o in OPTIONS)

#: Every accepted keyword name (frozenset of str).
OPTION_NAMES = frozenset(o.name for o in OPTIONS)
_FIELDS = frozenset(f.name for f in fields(Options))
# Options attributes rlm.config.build.build_options sets from the endpoint or the opened journal
_RESOLVED = frozenset({"model", "sub_model", "child_model", "base_url", "api_key",
                       "sub_api_key", "journal", "price_file"})


def check_names(names: Iterable[str]) -> None:
    """Refuse keyword names that are not options.

    Raises:
        ConfigError: ``unknown option(s): a, b`` (sorted).
    """
    unknown = set(names) - OPTION_NAMES
    if unknown:
        raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")


# -- the endpoint ----------------------------------------------------------------------------
