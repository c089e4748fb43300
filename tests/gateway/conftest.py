"""Fixtures of the gateway tests: the session's real Jupyter Kernel Gateway (see
:mod:`gw_helpers`), and the options that put a run's kernels on it."""
from __future__ import annotations

import shutil

import pytest

from gw_helpers import start_gateway, why_not


@pytest.fixture(scope="session")
def gateway():
    """The session's gateway (see the module's text)."""
    why = why_not()
    if why:
        pytest.skip(why)
    gw = start_gateway()
    yield gw
    gw.stop()
    shutil.rmtree(gw.home, ignore_errors=True)


@pytest.fixture
def on_gateway(gateway, monkeypatch):
    """Options that put every kernel of a run on the session's gateway (its token in the
    environment, as a user sets it)."""
    monkeypatch.setenv("JUPYTER_GATEWAY_AUTH_TOKEN", gateway.token)
    return {"kernels": "gateway", "gateway_url": gateway.url}
