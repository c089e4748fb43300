"""``.toml`` contexts, the worked example of adding a format through the one table
(:data:`rlm.context.formats.FORMATS`): a TOML file reaches the kernel as its parsed value (a
dict, like a ``.json`` object), a malformed one is refused naming the file and the line and
column TOML reports (CLI exit 2, no model call), and in a directory a ``.toml`` file is
converted like ``.jsonl``/``.csv`` (a malformed one kept as text, with a note)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import rlm
from conftest import API_KEY, MODEL, assert_clean_error, endpoint_args, repl, script
from rlm.context import formats
from rlm.context.load import describe, load_context

CONFIG = """\
# a service's settings
title = "Ingest"
retries = 3
ratio = 0.25
enabled = true
started = 1979-05-27T07:32:00Z
day = 1979-05-27

[owner]
name = "Tom"
tags = ["a", "b"]

[[servers]]
host = "alpha"
port = 8001

[[servers]]
host = "beta"
port = 8002
"""

#: CONFIG as the kernel must see it: tables are dicts, arrays lists, dates ISO 8601 strings
VALUE = {"title": "Ingest", "retries": 3, "ratio": 0.25, "enabled": True,
         "started": "1979-05-27T07:32:00+00:00", "day": "1979-05-27",
         "owner": {"name": "Tom", "tags": ["a", "b"]},
         "servers": [{"host": "alpha", "port": 8001}, {"host": "beta", "port": 8002}]}

BAD = 'title = "Ingest"\nretries = 3\nport = \n'  # line 3: a key with no value


def _value(ctx):
    try:
        return ctx.read_value()
    finally:
        ctx.discard()


def test_a_toml_file_reaches_the_kernel_as_a_dict(scripted, tmp_path):
    (tmp_path / "config.toml").write_text(CONFIG)
    srv = scripted(script([repl("import json",
                                "FINAL(json.dumps([type(context).__name__, context], "
                                "sort_keys=True))")]))
    res = rlm.completion(tmp_path / "config.toml", "q", base_url=srv.base_url, api_key=API_KEY,
                         model=MODEL, journal=False)
    assert res.status == "completed", res.reason
    kind, value = json.loads(res.answer)
    assert kind == "dict" and value == VALUE
    # the model is told what it holds, by keys and sizes, never the contents
    system = srv.requests[0]["messages"][0]["content"]
    assert "a dict of TOML keys and values read from config.toml" in system
    assert "8 keys" in system and "alpha" not in system and "Ingest" not in system


def test_a_malformed_toml_file_is_refused_naming_the_file_and_where(cli, scripted, tmp_path):
    srv = scripted(lambda req: repl("FINAL('unreachable')"))
    (tmp_path / "bad.toml").write_text(BAD)
    res = cli("run", "--context", str(tmp_path / "bad.toml"), "--query", "q?",
              *endpoint_args(srv))
    assert_clean_error(res, 2, "bad.toml", "is not valid TOML", r"\(line 3, column 8: ")
    assert res.stdout == "" and srv.count == 0


def test_a_directory_with_a_toml_file(cli, scripted, tmp_path):
    d = tmp_path / "svc"
    (d / "conf").mkdir(parents=True)
    (d / "conf" / "app.toml").write_text(CONFIG)
    (d / "conf" / "broken.toml").write_text(BAD)
    (d / "README.md").write_text("# svc\n")
    srv = scripted(script([repl("import json", "FINAL(json.dumps(context, sort_keys=True))")]))
    res = cli("run", "--context", str(d), "--query", "q?", "--no-journal", "-q",
              *endpoint_args(srv))
    assert res.rc == 0, res.stderr
    assert json.loads(res.stdout) == {"README.md": "# svc\n", "conf/app.toml": VALUE,
                                      "conf/broken.toml": BAD}
    system = srv.requests[0]["messages"][0]["content"]
    assert "1 key(s) whose value is a dict of keys and values (TOML) (conf/app.toml)" in system
    assert "conf/broken.toml: kept as text: line 3, column 8: " in system
    assert "alpha" not in system


def test_toml_files_without_a_kernel(tmp_path):
    (tmp_path / "c.toml.gz").write_bytes(gzip.compress(CONFIG.encode()))
    ctx = load_context(tmp_path / "c.toml.gz")
    assert ctx.fmt == "json" and ctx.owned
    assert describe(ctx)["note"] == "It holds a dict of TOML keys and values read from c.toml.gz."
    assert describe(ctx)["listing"].endswith(describe(ctx)["note"])
    assert _value(ctx) == VALUE
    (tmp_path / "UPPER.TOML").write_text('a = 1\n')
    assert _value(load_context(tmp_path / "UPPER.TOML")) == {"a": 1}
    (tmp_path / "comments.toml").write_text("# nothing but a comment\n")
    with pytest.raises(rlm.ContextError, match=r"comments.toml is empty \(no keys\)"):
        load_context(tmp_path / "comments.toml")
    (tmp_path / "end.toml").write_text('a = [1, 2')
    with pytest.raises(rlm.ContextError, match=r"end.toml is not valid TOML \((line|at the end)"):
        load_context(tmp_path / "end.toml")


def test_the_error_position_from_either_form_of_toml_error():
    """Python 3.11-3.13 put the position in the message; tomli 2.1+ and Python 3.14 give
    ``lineno``/``colno``/``msg`` too: both name the line and column."""
    class Attributed(ValueError):
        msg, lineno, colno = "Invalid value", 3, 8

    assert formats._toml_where(Attributed("Invalid value (at line 3, column 8)")) == \
        "line 3, column 8: Invalid value"
    assert formats._toml_where(ValueError("Invalid value (at line 3, column 8)")) == \
        "line 3, column 8: Invalid value"
    assert formats._toml_where(ValueError("Unclosed array (at end of document)")) == \
        "at the end: Unclosed array"


def test_toml_is_one_entry_of_the_table():
    fmt = formats.format_of("app.toml")
    assert fmt.kind == "toml" and fmt.suffixes == (".toml",) and fmt in formats.FORMATS
    assert formats.format_of("app.toml", directory=True) is fmt
    assert formats.describe_kind("toml") == "a dict of keys and values (TOML)"
    assert formats.describe_kind("toml", phrase=True) == "a dict of TOML keys and values"
    assert (".toml", "a dict of keys and values (TOML)") in formats.overview()
    assert Path(formats.__file__).read_text().count('".toml"') == 1  # named once, in the table
