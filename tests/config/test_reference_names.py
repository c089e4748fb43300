"""The reference implementation's constructor options: each is an alias where the meaning is
the same here, or an error naming this harness's replacement, never a bare unknown option."""
from __future__ import annotations

import json

import pytest

import rlm
from conftest import API_KEY, MODEL, repl
from rlm.config.reference import REFERENCE_NAMES, from_reference


def test_backend_and_its_kwargs_are_the_endpoint_options():
    r = rlm.RLM(backend="openai", backend_kwargs={"model_name": "gpt-x", "api_key": "k",
                                                  "base_url": "http://127.0.0.1:9/v1"})
    assert r.options == {"provider": "openai", "model": "gpt-x", "api_key": "k",
                         "base_url": "http://127.0.0.1:9/v1"}
    assert rlm.RLM(backend="anthropic").options == {"provider": "anthropic"}
    assert rlm.RLM(backend="vllm", backend_kwargs={"base_url": "http://h/v1"}).options[
        "provider"] == "openai"
    with pytest.raises(rlm.ConfigError, match="base_url="):
        rlm.RLM(backend="portkey")
    with pytest.raises(rlm.ConfigError, match="'temperature'.*options"):
        rlm.RLM(backend_kwargs={"model_name": "m", "temperature": 0})
    with pytest.raises(rlm.ConfigError, match="disagree"):
        rlm.RLM(model="a", backend_kwargs={"model_name": "b"})


@pytest.mark.parametrize("name, value, needle", [
    ("persistent", True, "rlm.Session"),
    ("logger", object(), "result.tree"),
    ("custom_sub_tools", {}, "levels=\\[0\\]"),
    ("other_backends", ["anthropic"], "sub_model="),
    ("environment", "docker", "sandbox="),
    ("custom_system_prompt", "be brief", "prompt="),
    ("on_iteration_start", print, "listeners="),
])
def test_an_option_without_an_equivalent_names_the_replacement(name, value, needle):
    with pytest.raises(rlm.ConfigError, match=needle) as exc:
        rlm.RLM(**{name: value})
    assert "unknown option" not in str(exc.value)
    assert f"{name}= is the reference implementation's option" in str(exc.value)


def test_defaults_that_mean_the_same_are_accepted():
    assert rlm.RLM(persistent=False, compaction=True, verbose=False, environment="local",
                   logger=None, depth=0).options == {}
    assert rlm.RLM(compaction=False).options == {"context_window": 0}
    assert rlm.RLM(compaction_threshold_pct=0.9, max_budget=2.0, max_timeout=30).options == {
        "compact_at": 0.9, "max_cost_usd": 2.0, "max_wall_seconds": 30}
    assert REFERENCE_NAMES >= {"backend", "backend_kwargs", "custom_tools", "persistent",
                               "compaction", "verbose"}
    plain = {"model": "m", "max_depth": 2}
    assert from_reference(plain) is plain  # no reference name: untouched


def _room_of(name: str) -> int:
    return {"alice": 101}[name]


def test_custom_tools_and_verbose_in_a_real_run(api, capfd):
    res, srv = api(lambda req: repl("FINAL(str(room_of('alice')))"),
                   custom_tools={"room_of": {"tool": _room_of, "description": "A room number"}},
                   verbose=True, journal=False)
    assert res.status == "completed", res.reason
    assert res.answer == "101"
    system = srv.requests[0]["messages"][0]["content"]
    assert "room_of(name: str) -> int" in system and "A room number" in system
    assert "[rlm] " in capfd.readouterr().err  # verbose: progress lines on stderr
    with pytest.raises(rlm.ConfigError, match="not a function"):
        rlm.RLM(custom_tools={"API_KEY": "sk-..."})


def test_root_prompt_is_the_query(scripted):
    srv = scripted(lambda req: repl("FINAL('ok')"))
    res = rlm.completion("some context", root_prompt="WHERE-IS-IT?", base_url=srv.base_url,
                         api_key=API_KEY, model=MODEL, journal=False)
    assert res.status == "completed"
    assert "WHERE-IS-IT?" in json.dumps(srv.requests[0]["messages"])
    with rlm.RLM(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=False) as r:
        assert r.completion("ctx", root_prompt="AGAIN?").answer == "ok"
    assert "AGAIN?" in json.dumps(srv.requests[-1]["messages"])


def test_a_session_is_what_persistent_asks_for(scripted):
    srv = scripted(lambda req: repl("FINAL('ok')"))
    with rlm.Session("ctx", persistent=True, verbose=False, base_url=srv.base_url,
                     api_key=API_KEY, model=MODEL, journal=False) as s:
        assert s.ask("q1").answer == "ok"
        assert s.ask("q2", root_prompt=None, compaction=True).answer == "ok"
