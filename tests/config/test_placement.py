"""Where a run's kernels run (``--kernels``, ``--gateway-url``, ``$JUPYTER_GATEWAY_*``): parsed,
refused before anything starts when wrong, and the token taken from the environment only."""
from __future__ import annotations

import pytest

from kernels.gateway.kernel import GatewayKernel
from kernels.kernel import Kernel
from kernels.provider import Placement, kernel_factory, parse_placement
from rlm.config.validate import validate_options
from rlm.errors import ConfigError


@pytest.mark.parametrize("value,root,children", [
    (None, "local", "local"), ("local", "local", "local"), ("gateway", "gateway", "gateway"),
    ("root=local,children=gateway", "local", "gateway"), ("children=gateway", "local", "gateway"),
    (" root = gateway ", "gateway", "local"),
])
def test_placements_parse(value, root, children, monkeypatch):
    monkeypatch.delenv("JUPYTER_GATEWAY_URL", raising=False)
    p = parse_placement(value, "http://gw:1")
    assert (p.root, p.children, p.gateway_url) == (root, children, "http://gw:1")
    assert p.provider(0) == root and p.provider(3) == children


@pytest.mark.parametrize("value,needle", [
    ("galaxy", "must be local, gateway"), ("root=local,kids=gateway", "roles root= and"),
    ("root=moon", "not 'moon'"),
])
def test_bad_placements_are_refused_before_anything_starts(value, needle):
    with pytest.raises(ConfigError, match=needle):
        validate_options({"kernels": value})


def test_a_gateway_placement_needs_a_url_and_takes_it_from_the_environment(monkeypatch):
    monkeypatch.delenv("JUPYTER_GATEWAY_URL", raising=False)
    with pytest.raises(ConfigError, match="--gateway-url URL or set"):
        validate_options({"kernels": "children=gateway"})
    validate_options({"kernels": "local"})  # no gateway, no URL needed
    monkeypatch.setenv("JUPYTER_GATEWAY_URL", "ftp://nope")
    with pytest.raises(ConfigError, match="JUPYTER_GATEWAY_URL must be an http"):
        validate_options({"kernels": "gateway"})
    monkeypatch.setenv("JUPYTER_GATEWAY_URL", "http://gw.example:8888")
    validate_options({"kernels": "gateway"})
    assert parse_placement("gateway").gateway_url == "http://gw.example:8888"


def test_the_factory_makes_each_roles_kernel_with_the_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("JUPYTER_GATEWAY_AUTH_TOKEN", "tok-from-env")
    p = Placement(root="local", children="gateway", gateway_url="http://gw:1")
    assert isinstance(kernel_factory(p, 0)(), Kernel)
    k = kernel_factory(p, 1)()
    assert isinstance(k, GatewayKernel) and k.client._token == "tok-from-env"
