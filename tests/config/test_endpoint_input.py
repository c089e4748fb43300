"""Endpoint and journal settings that would run somewhere the user did not mean, or put a secret
where it is journaled: refused before anything starts, with the reason and what to do."""
from __future__ import annotations

import pytest

import rlm
from rlm.config.endpoint import external_endpoint
from rlm.config.validate import validate_options
from rlm.config.records import open_journal


def test_a_provider_without_an_endpoint_is_refused_not_run_on_the_embedded_model(monkeypatch):
    for var in ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-only")  # another provider's key: not used
    with pytest.raises(rlm.ConfigError, match="ANTHROPIC_API_KEY") as err:
        external_endpoint({"provider": "anthropic", "model": "claude-x"})
    assert "embedded" not in str(err.value) and "OPENAI" not in str(err.value)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    assert external_endpoint({"provider": "anthropic", "model": "claude-x"}).api_key == "k"


def test_model_without_endpoint_names_the_providers_variables(monkeypatch):
    for var in ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(rlm.ConfigError, match="ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY"):
        validate_options({"provider": "anthropic", "model": "claude-x"})
    with pytest.raises(rlm.ConfigError, match="OPENAI_BASE_URL / OPENAI_API_KEY"):
        validate_options({"model": "gpt-x"})


@pytest.mark.parametrize("url", ["http://u:pw-SECRET@127.0.0.1:1/v1",
                                 "http://127.0.0.1:1/v1?api-key=SECRET",
                                 "https://user@h.example/v1"])
def test_a_base_url_carrying_credentials_or_a_query_is_refused_and_masked(url):
    with pytest.raises(rlm.ConfigError, match="credentials or a query") as err:
        validate_options({"base_url": url, "model": "m"})
    assert "SECRET" not in str(err.value)


@pytest.mark.parametrize("spec", ["sqlite:///tmp/x.db", "mysql://h/db", "postgresq://h/db",
                                  "POSTGRESQL://h/db"])
def test_a_journal_url_of_another_scheme_is_refused_not_made_a_relative_file(spec, tmp_path,
                                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(rlm.ConfigError, match="SQLite file path or a postgresql:// URL"):
        open_journal(spec)
    assert list(tmp_path.iterdir()) == []  # nothing created
