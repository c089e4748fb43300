"""The option registry (rlm/config/options.py): one declaration per option, everything else derived.

Checks that the options and CLI reference (docs/reference/options.md), argparse, validation, the
run's Options and the journal record all agree with :data:`rlm.config.options.OPTIONS`. No
kernels, no model: pure bookkeeping.

The reference is written by ``scripts/gen_reference.py`` from the registry and the CLI parser;
the test renders it in memory and compares it with the checked-in file.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.budget.accountant import Budget
from rlm.config import options as reg
from rlm.cli.main import build_parser, options_from_args
from rlm.errors import ConfigError
from rlm.config.options import OPTIONS, Endpoint, Options
from rlm.config.validate import validate_options
from rlm.config.build import build_options, replay_options, resume_options, stored_options

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference" / "options.md"
ENDPOINT = Endpoint("http://127.0.0.1:9/v1", "k", "m")


@pytest.fixture(autouse=True)
def _no_endpoint_env(monkeypatch):
    for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "RLM_MODEL"):
        monkeypatch.delenv(k, raising=False)


# -- the options and CLI reference, generated from the registry ------------------------------

def _generator():
    """``scripts/gen_reference.py`` as a module (scripts/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_reference",
                                                  REPO / "scripts" / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_options_reference_is_generated_from_the_registry():
    hint = ("docs/reference/options.md differs from the registry and the CLI parser; "
            "regenerate it with: .venv/bin/python scripts/gen_reference.py")
    gen = _generator()
    expected = gen.render()
    assert REFERENCE.is_file(), hint
    current = REFERENCE.read_text(encoding="utf-8")
    if current != expected:
        import difflib
        diff = "".join(list(difflib.unified_diff(
            current.splitlines(True), expected.splitlines(True), "checked in", "generated"))[:40])
        pytest.fail(f"{hint}\n{diff}")
    for o in OPTIONS:  # every option has its row (the generator's own rules aside)
        cell = f"| {gen._flag_cell(o)} | `{o.name}` |" if o.flag else f"| `{o.name}` |"
        assert cell in current, o.name


def test_names_are_unique_and_flags_are_unique():
    assert len(reg.OPTION_NAMES) == len(OPTIONS)
    flags = [o.flag for o in OPTIONS if o.flag] + [s.flag for o in OPTIONS for s in o.switches]
    assert len(flags) == len(set(flags))
    for o in OPTIONS:
        assert o.group in (None, *reg.GROUP_TITLES)
        assert o.doc, o.name
        assert not o.flag or o.help, o.name
        assert o.budget_field is None or o.budget_field in {f.name for f in fields(Budget)}
        assert (o.min is None) == (o.max is None), o.name
        assert (o.min is not None) <= (o.type in (int, float)), o.name


def test_registry_defaults_are_the_dataclass_defaults():
    opts, budget = Options(), Budget()
    for o in OPTIONS:
        if o.to_options:
            assert getattr(opts, o.name) == o.default, o.name
        if o.budget_field:
            assert getattr(budget, o.budget_field) == o.default, o.name


def test_embedded_model_names_are_the_embedded_registry():
    from rlm.models import embedded
    assert set(embedded.MODELS) == set(reg.EMBEDDED_MODELS)
    assert embedded.DEFAULT_MODEL == reg.DEFAULT_EMBEDDED_MODEL


def test_unknown_names_are_refused():
    reg.check_names(reg.OPTION_NAMES)
    with pytest.raises(ConfigError, match=r"^unknown option\(s\): bogus, zz$"):
        reg.check_names(["zz", "model", "bogus"])


# -- argparse --------------------------------------------------------------------------------

def _sample(o) -> str:
    if o.choices:
        return str(o.choices[-1])
    if o.type is int:
        return str(int(o.min or 0) + 1)
    if o.type is float:
        return "2.5"
    return "http://h/v1" if o.name == "base_url" else f"v-{o.name}"


def _argv(command: str) -> list[str]:
    return {"run": ["run", "--context", "c.txt"], "resume": ["resume", "R"],
            "replay": ["replay", "R"], "show": ["show", "R"], "runs": ["runs"],
            "export": ["export", "R"], "verify": ["verify", "R"], "serve": ["serve"],
            "chat": ["chat", "--context", "c.txt"]}[command]


def test_argparse_accepts_every_flag_of_every_command():
    parser = build_parser()
    commands = {c for o in OPTIONS for c in o.commands}
    assert commands == {"run", "resume", "replay", "show", "runs", "export", "verify", "serve",
                        "chat"}
    for command in commands:
        takes = [o for o in OPTIONS if o.flag and command in o.commands]
        argv = _argv(command)
        for o in takes:  # a bool option is a flag without a value
            argv += ([o.flag] if o.type is bool else [o.flag, _sample(o)]) + \
                ([o.flag, _sample(o) + "2"] if o.repeat else [])
        args = parser.parse_args(argv)
        got = options_from_args(args, command)
        want = {o.name: (True if o.type is bool else
                         o.type(_sample(o)) if o.type in (int, float) else _sample(o))
                for o in takes}
        # a repeatable flag (--include, --exclude) gives the list of its values
        want.update({o.name: [_sample(o), _sample(o) + "2"] for o in takes if o.repeat})
        assert got == want, command
        # nothing given: nothing passed on, so the run's defaults apply
        assert options_from_args(parser.parse_args(_argv(command)), command) == {}


def test_switches_win_over_their_option_flag():
    parser = build_parser()
    args = parser.parse_args(["run", "--context", "c", "--embedded-model", "smollm2-135m",
                              "--large", "--journal", "j.db", "--no-journal"])
    got = options_from_args(args, "run")
    assert got == {"embedded_model": reg.LARGE_EMBEDDED_MODEL, "journal": False}
    assert options_from_args(parser.parse_args(["resume", "R", "--large"]), "resume") == {
        "embedded_model": reg.LARGE_EMBEDDED_MODEL}
    with pytest.raises(SystemExit):
        parser.parse_args(["resume", "R", "--no-journal"])


def test_serve_takes_its_run_defaults_from_the_registry_as_run_does():
    """Every registry flag of ``rlm serve`` is declared as ``rlm run`` declares it (one action,
    type, choices and help), and the journal switches work there too."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {c: {f: a for a in sub.choices[c]._actions for f in a.option_strings}
             for c in ("run", "serve")}
    served = [o for o in OPTIONS if o.flag and "serve" in o.commands]
    assert {o.name for o in served} >= {"journal", "base_url", "model", "max_depth",
                                        "max_cost_usd", "price_file", "provider"}
    for o in served:
        run, serve = flags["run"][o.flag], flags["serve"][o.flag]
        assert (type(serve), serve.type, serve.choices, serve.help) == \
            (type(run), run.type, run.choices, run.help), o.flag
    args = parser.parse_args(["serve", "--no-journal", "--max-depth", "2"])
    assert options_from_args(args, "serve") == {"journal": False, "max_depth": 2}
    # serve's --api-key is the key its clients send, never the upstream's
    assert "api_key" not in {o.name for o in served}


def test_empty_values_of_plumbing_flags_are_not_given_but_an_empty_url_is():
    parser = build_parser()
    args = parser.parse_args(["run", "--context", "c", "--run-id", "", "--journal", "",
                              "--encoding", "", "--base-url", ""])
    assert options_from_args(args, "run") == {"base_url": ""}
    with pytest.raises(ConfigError, match="--base-url must be an http"):
        validate_options(options_from_args(args, "run"))


def test_limits_are_run_only():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["resume", "R", "--max-depth", "2"])


# -- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("opt", [o for o in OPTIONS if o.min is not None], ids=lambda o: o.name)
def test_every_range_error_names_its_flag(opt):
    label = opt.flag if opt.flag and "run" in opt.commands else opt.name
    assert opt.label == label
    low = opt.min if opt.min_exclusive else opt.min - 1
    for bad in (low, opt.max * 2 + 1):
        with pytest.raises(ConfigError) as err:
            validate_options({opt.name: bad})
        assert str(err.value).startswith(f"{label} must be "), str(err.value)
        hi = int(opt.max) if float(opt.max).is_integer() and opt.max < 1e15 else f"{opt.max:g}"
        assert f"<= {hi}, got {bad!r}" in str(err.value)  # whole limits in full, not 1.05e+06
    for bad in ("x", float("nan"), True):
        with pytest.raises(ConfigError, match=f"^{re.escape(label)} must be a finite number"):
            validate_options({opt.name: bad})
    if opt.type is int:
        with pytest.raises(ConfigError, match=f"^{re.escape(label)} must be a whole number"):
            validate_options({opt.name: opt.min + 1.5})
    validate_options({opt.name: opt.max})
    validate_options({opt.name: None})


@pytest.mark.parametrize("options, message", [
    ({"max_depth": 9}, "--max-depth must be >= 0 and <= 8, got 9"),
    ({"cell_timeout": 0}, "--cell-timeout must be > 0 and <= 86400, got 0"),
    ({"max_tokens": 0}, "--max-tokens must be >= 1 and <= 1e+15, got 0"),
    ({"max_completion_tokens": 0}, "max_completion_tokens must be >= 1 and <= 1000000, got 0"),
    ({"base_url": "ftp://x"}, "--base-url must be an http:// or https:// URL such as "
                              "http://127.0.0.1:8000/v1, got 'ftp://x'"),
    ({"run_id": "  "}, "--run-id must not be empty"),
    ({"run_id": 5}, "--run-id must be a string, got int 5"),
    ({"run_id": "a\nb"}, "--run-id must be at most 200 printable characters"),
    ({"model": 5}, "--model must be a string, got int 5"),
    ({"api_key": 5}, "--api-key must be a string, got int 5"),
    ({"journal": 5}, "journal must be a path, a postgresql:// URL, False or a Journal, got int 5"),
    ({"listeners": 5}, "listeners must be a list of callables, got 5"),
    ({"on_progress": 5}, "on_progress must be callable, got 5"),
    ({"divergence": "maybe"}, "divergence must be 'stop' or 'live'"),
    ({"include": 3}, "--include must be a glob pattern or a list of them, got 3"),
    ({"exclude": ["*.py", None]}, "--exclude must be a glob pattern or a list of them, got "
                                  "['*.py', None]"),
    ({"price_file": ""}, "--price-file is empty: give the path of a JSON price file"),
    ({"price_file": " "}, "--price-file is empty: give the path of a JSON price file"),
    ({"price_file": 5}, "--price-file must be a path, got int 5"),
    ({"model": "m"}, "--model 'm' needs an endpoint: pass --base-url (or set OPENAI_BASE_URL / "
                     "OPENAI_API_KEY); without one the embedded model is used, chosen with "
                     "--embedded-model"),
])
def test_validation_messages(options, message):
    with pytest.raises(ConfigError) as err:
        validate_options(options)
    assert str(err.value) == message
    assert reg.MAX_DEPTH_LIMIT == 8


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:abc/v1", "Port could not be cast"), ("http://127.0.0.1:99999/v1", "range"),
    ("http://256.1.1.1/v1", "not an IPv4 address"), ("http://[::1/v1", "IPv6"),
    ("http:///v1", "no host"), ("http://exa mple.com/v1", "got"), (8000, "got 8000"),
    ("http://a..b/v1", "empty label"), ("http://127.0.0.1:0/v1", "port 0"),
])
def test_a_base_url_the_client_could_not_send_to_is_refused_before_the_run(url, why,
                                                                            monkeypatch):
    # each of these reached the HTTP client, whose own error then ended the run as an
    # internal one (exit 1) and left it 'running' in the journal
    with pytest.raises(ConfigError) as err:
        validate_options({"base_url": url})
    assert str(err.value).startswith("--base-url must be an http:// or https:// URL")
    assert why in str(err.value)
    monkeypatch.setenv("OPENAI_BASE_URL", str(url))
    with pytest.raises(ConfigError, match="^OPENAI_BASE_URL must be an http"):
        validate_options({})
    for good in ("http://127.0.0.1:8000/v1", "https://api.openai.com/v1", "http://[::1]:80/v1",
                 "http://localhost/v1"):
        validate_options({"base_url": good})


def test_endpoint_is_configured_by_options_or_environment(monkeypatch):
    assert not reg.endpoint_configured({})
    assert reg.external_endpoint({}) is None
    assert reg.endpoint_configured({"base_url": "http://h/v1"})
    assert reg.external_endpoint({"api_key": "k", "model": "m"}) == Endpoint(
        "https://api.openai.com/v1", "k", "m")
    with pytest.raises(ConfigError, match="no model name"):
        reg.external_endpoint({"base_url": "http://h/v1"})
    monkeypatch.setenv("OPENAI_API_KEY", "envk")
    monkeypatch.setenv("RLM_MODEL", "envm")
    assert reg.endpoint_configured({})
    validate_options({"model": "m"})
    assert reg.external_endpoint({}) == Endpoint("https://api.openai.com/v1", "envk", "envm")


# -- the run's Options -----------------------------------------------------------------------

def test_build_options_defaults_and_embedded_defaults():
    ext = build_options({"base_url": "http://h/v1", "model": "m", "sub_model": "s"}, ENDPOINT)
    emb = build_options({"sub_model": "s"}, ("http://127.0.0.1:1/v1", "x", "local"))
    assert not ext.embedded and emb.embedded
    assert ext.sub_model == "s" and emb.sub_model is None and emb.model == "local"
    for o in OPTIONS:
        if o.to_options:
            assert getattr(ext, o.name) == o.default, o.name
            assert getattr(emb, o.name) == o.default_for(True), o.name
        if o.budget_field:
            assert getattr(ext.budget, o.budget_field) == o.default, o.name
            assert getattr(emb.budget, o.budget_field) == o.default_for(True), o.name
    assert emb.prices.is_local("local") and not ext.prices.is_local("m")
    whole = build_options({"base_url": "http://h/v1", "max_depth": 2.0, "pool_size": 3.0}, ENDPOINT)
    assert whole.budget.max_depth == 2 and type(whole.budget.max_depth) is int
    assert type(whole.pool_size) is int


def _given(o):
    """A valid non-default value for option ``o``."""
    if o.type is bool:
        return not o.default
    if o.choices:
        return [c for c in o.choices if c != o.default][0]
    if o.name == "context_window":
        return 9000
    if o.type is int:
        return int(o.min or 0) + 2
    if o.type is float:
        return 0.5 if o.name in ("temperature", "compact_at") else 3.5
    return {"base_url": "http://h/v1", "sub_base_url": "http://s/v1",
            "system_template": "T {meta}", "prompt": "small",
            "kernels": "root=local,children=gateway", "gateway_url": "http://gw:8888"}.get(o.name, f"v-{o.name}")


def _record(opts: Options) -> dict:
    ctx = SimpleNamespace(source="/tmp/c.txt", fmt="text", encoding="utf-8", sha256="abc")
    return {"run_id": "R", "options": json.loads(json.dumps(stored_options(opts, ctx)))}


def test_every_stored_option_round_trips_through_the_journal_record(tmp_path):
    given = {o.name: _given(o) for o in OPTIONS if o.stored}
    prices = tmp_path.resolve() / "prices.json"  # recorded as its absolute path
    prices.write_text('{"m": {"input": 1, "output": 2}}')
    given["price_file"] = str(prices)
    kw = {**given, "api_key": "secret-key", "sub_api_key": "sub-secret-key"}
    opts = build_options(kw, reg.external_endpoint(kw))
    assert opts.sub_api_key == "sub-secret-key" and "sub-secret" not in repr(opts)
    rec = _record(opts)
    assert "secret-key" not in json.dumps(rec)  # neither key (the sub-call one ends the same)
    back = resume_options(rec)
    assert back == given
    validate_options(back)
    again = build_options(back, reg.external_endpoint(back))
    replayed = replay_options(rec)
    for o in OPTIONS:
        if o.stored and o.name in {f.name for f in fields(Options)}:
            assert getattr(again, o.name) == getattr(opts, o.name), o.name
            assert getattr(replayed, o.name) == getattr(opts, o.name), o.name
    assert again.budget == opts.budget == replayed.budget
    assert _record(again)["options"] == rec["options"]


def test_options_not_stored_stay_out_of_the_record(tmp_path):
    # tools: recorded as their specs, not as the value given (tests/tools/test_tools_spec.py)
    # sub_api_key: refused without sub_base_url (tests/core/test_sub_endpoint.py)
    given = {o.name: _given(o) for o in OPTIONS
             if not o.stored and o.name not in ("journal", "tools", "sub_api_key")}
    opts = build_options(given, ENDPOINT)
    for o in OPTIONS:
        if o.to_options and o.name in given:  # every given value reaches the run
            assert getattr(opts, o.name) == given[o.name], o.name
    rec = _record(opts)
    for name in given:
        assert name not in rec["options"], name
    assert resume_options(rec).keys() <= {o.name for o in OPTIONS if o.stored}


def test_a_run_on_the_embedded_model_resumes_without_its_endpoint_options():
    opts = build_options({"max_depth": 2}, ("http://127.0.0.1:1/v1", "x", "local"))
    rec = _record(opts)
    back = resume_options(rec)
    assert back["max_depth"] == 2 and back["max_iterations"] == 6
    assert not {o.name for o in OPTIONS if o.group == reg.ENDPOINT} & set(back)
    assert replay_options(rec).model == "local"  # replay keeps the names the requests hashed


def test_cli_help_lists_every_flag():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        text = p.format_help()
        for o in OPTIONS:
            if o.flag and command in o.commands:
                assert o.flag in text, (command, o.flag)
            for s in o.switches:
                assert (s.flag in text) == (command in s.commands), (command, s.flag)
