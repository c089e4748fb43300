"""The docs check can fail: ``mkdocs build --strict -q`` (the command scripts/test.sh and the
docs give) exits 1 on a broken link or a page outside the nav, ``-q`` or not, and builds with
the eval reports (``eval/**/summary.md``) outside the nav.

Each build is of a small site made with the project's own settings (mkdocs.yml's validation,
``not_in_nav``, theme, extensions and hooks; the API reference plugin and the page list left
out, so each build takes a second or two) in a temporary directory."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, clean_env

PAGES = {
    "a.md": "# A\n\nSee [B](b.md) and [the report](eval/x/summary.md).\n",
    "b.md": "# B\n\nBack to [A](a.md#a).\n",
    "eval/x/summary.md": "12 trials in 3 cells.\n",
}


def _site(tmp_path, pages: dict) -> str:
    conf = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    conf["plugins"] = ["search"]
    conf["nav"] = [{"Home": "index.md"}, {"A": "a.md"}, {"B": "b.md"}]
    conf["hooks"] = [str(REPO / "scripts" / "mkdocs_hooks.py")]
    conf.pop("watch", None)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(conf))
    (tmp_path / "README.md").write_text("# Front\n\nStart at [A](docs/a.md).\n")
    for name, text in pages.items():
        path = tmp_path / "docs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def _build(root: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", *flags,
                           "-d", os.path.join(root, "site")], cwd=root, capture_output=True,
                          text=True, timeout=120, env=clean_env(NO_MKDOCS_2_WARNING="1"))


def test_the_site_builds_with_the_eval_reports_outside_the_nav(tmp_path):
    p = _build(_site(tmp_path, PAGES))
    assert p.returncode == 0, p.stderr
    assert "WARNING" not in p.stderr, p.stderr


@pytest.mark.parametrize("fault, flags", [
    ("broken link", ("-q",)), ("broken link", ()), ("broken anchor", ("-q",)),
    ("page outside the nav", ("-q",))])
def test_a_fault_fails_the_strict_build(tmp_path, fault, flags):
    pages = dict(PAGES)
    if fault == "broken link":
        pages["b.md"] += "\nSee [the missing page](missing.md).\n"
    elif fault == "broken anchor":
        pages["b.md"] += "\nSee [A's missing part](a.md#nowhere).\n"
    else:
        pages["c.md"] = "# C\n\nNot in the nav.\n"
    p = _build(_site(tmp_path, pages), *flags)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "in strict mode" in p.stdout + p.stderr, (p.stdout, p.stderr)


def test_the_docs_extra_installs_what_the_site_needs():
    import tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    conf = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    names = {d.split("[")[0].split(">")[0].split("=")[0].strip() for d in extras["docs"]}
    need = {"mkdocs-" + conf["theme"]["name"]} | {
        p if isinstance(p, str) else next(iter(p)) for p in conf["plugins"]} - {"search"}
    assert need <= names, (need, names)  # (search comes with mkdocs itself)
    assert set(extras["docs"]) <= set(extras["dev"])  # the tests build the docs too
