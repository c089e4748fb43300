"""File names that differ only in bytes that are not UTF-8 each keep their own key in a
directory context: a byte that is not UTF-8 is written ``\\xHH`` in the key, a real U+FFFD stays
itself, and two files whose keys would still agree both stay (the later one gets ``~2``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import rlm
from conftest import repl
from rlm.context.load import load_context
from rlm.context.sources import collect

# name on disk (bytes) -> (key, text)
MEMBERS = {
    b"caf\xe9.txt": ("caf\\xe9.txt", "latin-1 e-acute"),
    b"caf\xe8.txt": ("caf\\xe8.txt", "latin-1 e-grave"),
    b"caf\xc3\xa9.txt": ("caf\u00e9.txt", "utf-8 e-acute"),
    b"caf\xef\xbf\xbd.txt": ("caf\ufffd.txt", "a real replacement character"),
    b"d\xe9/a.txt": ("d\\xe9/a.txt", "under a latin-1 directory"),
    b"d\xef\xbf\xbd/a.txt": ("d\ufffd/a.txt", "under its U+FFFD twin"),
    b"x\xff\xfe.md": ("x\\xff\\xfe.md", "two bad bytes"),
    # a name that spells the escape of another: both stay, the later (by bytes) gets ~2
    b"lit\\xe9.txt": ("lit\\xe9.txt", "a backslash, spelled out"),
    b"lit\xe9.txt": ("lit\\xe9~2.txt", "the byte itself"),
}


def _tree(tmp_path) -> str:
    root = os.path.join(os.fsencode(str(tmp_path)), b"docs")
    for name, (_key, text) in MEMBERS.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return os.fsdecode(root)


def test_every_member_keeps_its_own_key(tmp_path):
    root = _tree(tmp_path)
    walk, _base, _origin = collect([root])
    keys = [k for k, _ in walk.files]
    assert sorted(keys) == sorted(k for k, _ in MEMBERS.values())
    assert len(set(keys)) == len(MEMBERS)
    assert walk.renamed == {"lit\\xe9~2.txt": "lit\\xe9.txt"}
    ctx = load_context(Path(root))
    try:
        listing = ctx.meta["listing"]
        assert "'lit\\\\xe9.txt', which another file has" in listing, listing
        for key, _ in MEMBERS.values():  # no surrogate in any key the prompt shows
            key.encode("utf-8")
    finally:
        ctx.discard()


def test_the_kernel_reads_each_member_under_its_key(tmp_path, api):
    root = _tree(tmp_path)
    res, _ = api(lambda req: repl("import json", "FINAL(json.dumps(context, sort_keys=True))"),
                 context=Path(root))
    assert res.status == "completed", res.reason
    got = json.loads(res.answer)
    assert got == {key: text for key, text in MEMBERS.values()}


def test_a_mapping_whose_keys_agree_once_escaped_is_refused(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("A")
    b.write_text("B")
    with pytest.raises(rlm.ContextError, match="the key 'k\\\\\\\\xe9'"):
        load_context({"k\udce9": a, "k\\xe9": b})
    ctx = load_context({"k\udce9": a, "k\ufffd": b})  # the U+FFFD twin is another key
    try:
        assert set(ctx.meta["item_chars"]) == {"k\\xe9", "k\ufffd"}
    finally:
        ctx.discard()
