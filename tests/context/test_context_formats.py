"""The one table of context formats (:data:`rlm.context.formats.FORMATS`): each suffix and
kind once, every loader and listing reading it, so that a new format is one converter and
one entry; and the JSON cases the single-file loader reads in place only when the kernel
can (a JSON file in a detected encoding, or a named pipe, goes through a scratch file)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlm.context import formats
from rlm.context.listing import describe_files
from rlm.context.load import describe, load_context
from rlm.errors import ContextError


def _value(ctx):
    try:
        return ctx.read_value()
    finally:
        ctx.discard()


def test_each_suffix_and_kind_is_in_one_entry():
    suffixes = [s for f in formats.FORMATS for s in f.suffixes]
    assert len(suffixes) == len(set(suffixes))
    kinds = [f.kind for f in formats.FORMATS if f.kind != "text"]
    assert len(kinds) == len(set(kinds))
    for fmt in formats.FORMATS:
        for suf in fmt.suffixes:
            assert formats.format_of("a" + suf.upper()) is fmt
        assert formats.describe_kind(fmt.kind) in (fmt.description, formats.TEXT.description)
    assert formats.format_of("notes.txt") is formats.TEXT
    assert formats.format_of("Makefile") is formats.TEXT
    # a .json file in a directory is its text, read in place; a .jsonl one is converted
    assert formats.format_of("a.json", directory=True) is formats.TEXT
    assert formats.format_of("a.jsonl", directory=True).kind == "records"
    dup = formats.Format("other", (".csv",), "Other", "other", lambda t, s, x: t)
    with pytest.raises(ValueError, match="'.csv'"):
        formats._index(formats.FORMATS + (dup,))
    same_kind = formats.Format("rows", (".rows",), "Rows", "rows", lambda t, s, x: t)
    with pytest.raises(ValueError, match="'rows'"):
        formats._index(formats.FORMATS + (same_kind,))


def test_the_listing_and_the_note_describe_a_kind_from_the_table():
    listing = describe_files({"a.jsonl": ("records", 10), "b.pdf": ("pages", 5)})["listing"]
    assert f"whose value is {formats.describe_kind('records')} (a.jsonl)" in listing
    assert f"whose value is {formats.describe_kind('pages')} (b.pdf)" in listing


def test_a_new_format_is_one_converter_and_one_entry(monkeypatch, tmp_path):
    """A made-up ``.words`` format, added to the table alone, is read by suffix as a single
    file and inside a directory, described in the listing and the note, malformed files
    refused (alone) or kept as text (in a directory)."""
    def words(text: str, source: str, suffix: str) -> list:
        if "!" in text:
            raise ContextError(f"context {source} is not valid words (line 1: a '!')")
        return text.split()

    new = formats.Format("words", (".words",), "Words", "a list of {name} tokens", words)
    by_suffix, by_kind = formats._index(formats.FORMATS + (new,))
    monkeypatch.setattr(formats, "FORMATS", formats.FORMATS + (new,))
    monkeypatch.setattr(formats, "_BY_SUFFIX", by_suffix)
    monkeypatch.setattr(formats, "_BY_KIND", by_kind)

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.words").write_text("alpha beta\ngamma\n")
    (tmp_path / "d" / "bad.words").write_text("oops!\n")
    ctx = load_context(tmp_path / "d" / "a.words")
    assert describe(ctx)["note"] == "It holds a list of Words tokens read from a.words."
    assert _value(ctx) == ["alpha", "beta", "gamma"]
    with pytest.raises(ContextError, match="bad.words is not valid words"):
        load_context(tmp_path / "d" / "bad.words")
    ctx = load_context(tmp_path / "d")
    listing = describe(ctx)["listing"]
    assert _value(ctx) == {"a.words": ["alpha", "beta", "gamma"], "bad.words": "oops!\n"}
    assert "1 key(s) whose value is a list of tokens (Words) (a.words)" in listing
    assert "bad.words: kept as text: line 1: a '!'" in listing


def test_a_json_file_in_a_detected_encoding_reaches_the_kernel_through_a_scratch_file(tmp_path):
    """Its bytes are not UTF-8: the kernel, which reads JSON files as UTF-8, is given the
    value re-encoded, not the user's file (which it could not decode)."""
    from kernels.runtime import load_context as kernel_load

    value = {"t": "Le caf\u00e9 est tr\u00e8s bon, o\u00f9 est la biblioth\u00e8que? " * 5}
    p = tmp_path / "cp.json"
    p.write_bytes(json.dumps(value, ensure_ascii=False).encode("cp1252"))
    ctx = load_context(p)
    try:
        assert ctx.fmt == "json" and ctx.owned and ctx.path != str(p)
        assert kernel_load(ctx.path, ctx.fmt) == value
    finally:
        ctx.discard()
    p.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")  # UTF-8: in place
    ctx = load_context(p)
    assert not ctx.owned and ctx.path == str(p) and kernel_load(ctx.path, ctx.fmt) == value


def test_json_on_stdin_is_read_once_and_handed_over_and_a_json_fifo_is_refused(tmp_path,
                                                                               monkeypatch):
    """A stream is drained by the host: the kernel gets its value in a file of ours. It comes
    on stdin; a named pipe is refused before it is opened (with no writer it would block)."""
    import io
    import sys
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"through": "stdin"}')))
    ctx = load_context("-", is_json=True)
    try:
        assert ctx.owned
        assert json.loads(Path(ctx.path).read_text()) == {"through": "stdin"}
    finally:
        ctx.discard()
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(ContextError, match="is a FIFO, not a regular file"):
        load_context(fifo)
