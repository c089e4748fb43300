"""The provider-neutral seam (:mod:`rlm.models.base`): the ModelClient Protocol, the provider
table and its laziness, and the unknown-provider error."""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from conftest import REPO, clean_env
from rlm.errors import ConfigError
from rlm.models.base import (DEFAULT_PROVIDER, PROVIDERS, Completion, ModelClient, Provider,
                             make_client, provider_env, provider_spec)


def test_every_provider_is_a_lazy_factory_of_a_model_client():
    assert DEFAULT_PROVIDER == "openai" and {"openai", "anthropic"} <= set(PROVIDERS)
    for name, spec in PROVIDERS.items():
        assert isinstance(spec, Provider) and callable(spec)
        cls = spec.client_class()
        # the Protocol's surface, with complete's keyword-only parameters
        for method in ("complete", "prepare", "close"):
            assert callable(getattr(cls, method)), (name, method)
        want = inspect.signature(ModelClient.complete).parameters
        got = inspect.signature(cls.complete).parameters
        assert list(got) == list(want), name
        client = spec("http://127.0.0.1:9", "k", max_attempts=2)
        assert isinstance(client, ModelClient) and client.max_attempts == 2
        client.close()  # never built: nothing to close, no error


def test_importing_rlm_imports_no_provider_and_no_sdk():
    code = ("import sys, rlm, rlm.config.options\n"
            "from rlm.models.base import make_client\n"
            "bad = [m for m in ('openai', 'anthropic', 'rlm.models.openai_compat',\n"
            "       'rlm.models.anthropic_messages') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "c = make_client('openai', 'http://127.0.0.1:9/v1', 'k')\n"
            "assert 'rlm.models.openai_compat' in sys.modules and 'openai' not in sys.modules\n"
            "assert 'anthropic' not in sys.modules\n"
            "c.prepare()\n"
            "assert 'openai' in sys.modules and 'anthropic' not in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_an_unknown_provider_is_refused_naming_the_known_ones():
    for bad in ("nope", "", "OpenAI", 3):
        with pytest.raises(ConfigError) as ei:
            make_client(bad, "http://127.0.0.1:9", "k")
        assert "known providers are anthropic, openai" in str(ei.value)
    assert provider_spec(None) is PROVIDERS[DEFAULT_PROVIDER]


def test_each_provider_resolves_its_own_environment():
    assert provider_env("anthropic").key_env == "ANTHROPIC_API_KEY"
    assert provider_env("anthropic").default_url == "https://api.anthropic.com"
    assert provider_env(None).key_env == provider_env("nope").key_env == "OPENAI_API_KEY"


def test_the_openai_module_still_offers_the_old_names():
    from rlm.models import openai_compat
    assert openai_compat.Completion is Completion
    assert openai_compat.ModelClient is ModelClient  # the Protocol: an annotation, not a class
    assert openai_compat.DeadlineExceeded.__module__ == "rlm.models.base"
