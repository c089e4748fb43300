"""Loading contexts: bad files are refused with a clear message (CLI exit 2, no traceback),
good ones reach the kernel as ``context`` exactly: text, latin-1 with ``--encoding``,
``.json`` as dict/list, and stdin with ``--context -``."""
from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import rlm
from conftest import API_KEY, MODEL, assert_clean_error, endpoint_args, repl, script
from harness.journal import Journal
from rlm.context import formats
from rlm.context.load import describe, load_context
from rlm.errors import ContextError

# --------------------------------------------------------------------------- CLI: refused input


def _never(req):
    raise AssertionError("no model call may be made for a refused context")


@pytest.fixture
def refuse(cli, scripted, tmp_path):
    """``refuse(path_or_None, *extra, input=None) -> CLIResult`` for a context the CLI refuses;
    checks that no model request was made."""
    srv = scripted(_never)

    def go(context: str, *extra: str, input=None):
        res = cli("run", "--context", context, "--query", "q?", *endpoint_args(srv), *extra,
                  input=input, timeout=60)
        assert srv.count == 0
        assert res.stdout == ""
        return res

    return go


def test_empty_file(refuse, tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    assert_clean_error(refuse(str(tmp_path / "empty.txt")), 2, "empty", "empty.txt")


def test_whitespace_only_file(refuse, tmp_path):
    (tmp_path / "blank.txt").write_bytes(b"  \n\t\n  ")
    assert_clean_error(refuse(str(tmp_path / "blank.txt")), 2, "empty")


def test_binary_file(refuse, tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"%PDF-1.4\n\x00\x01\x02binary\x00stuff" * 10)
    assert_clean_error(refuse(str(tmp_path / "blob.bin")), 2, "binary", "NUL")


def test_missing_file(refuse, tmp_path):
    assert_clean_error(refuse(str(tmp_path / "nope.txt")), 2, "not found", "nope.txt")


def test_directory(refuse, tmp_path):
    (tmp_path / "adir").mkdir()
    assert_clean_error(refuse(str(tmp_path / "adir")), 2, "directory")


def test_non_utf8_file_with_explicit_utf8(refuse, tmp_path):
    """Detection is the default; an explicit --encoding is strict and says where it failed."""
    (tmp_path / "latin.txt").write_bytes("Le café est très bon. Ça va?\n".encode("latin-1"))
    res = refuse(str(tmp_path / "latin.txt"), "--encoding", "utf-8")
    assert_clean_error(res, 2, "not valid utf-8", r"--encoding latin-1", "byte 6")


def test_undetectable_bytes_are_refused(refuse, tmp_path):
    (tmp_path / "noise.txt").write_bytes(bytes(range(128, 256)) * 8)
    assert_clean_error(refuse(str(tmp_path / "noise.txt")), 2, "not valid UTF-8", "--encoding")


def test_unknown_encoding(refuse, tmp_path):
    (tmp_path / "t.txt").write_text("hello")
    assert_clean_error(refuse(str(tmp_path / "t.txt"), "--encoding", "no-such-codec"), 2,
                       "unknown encoding")


def test_malformed_json(refuse, tmp_path):
    (tmp_path / "bad.json").write_text('{"a": 1,\n "b": }')
    assert_clean_error(refuse(str(tmp_path / "bad.json")), 2, "not valid JSON", "line 2")


@pytest.mark.parametrize("body, kind", [("null", "null"), ("true", "boolean"), ("3.5", "number")])
def test_a_json_scalar_is_named_in_json_terms(refuse, tmp_path, body, kind):
    (tmp_path / "v.json").write_text(body)
    assert_clean_error(refuse(str(tmp_path / "v.json")), 2, f"holds a JSON {kind};")


def test_empty_stdin(refuse):
    assert_clean_error(refuse("-", input=""), 2, "empty", "stdin")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_device_is_refused_before_it_is_opened(refuse, device):
    # a device has no size and may never end (/dev/zero was once read until memory ran out)
    assert_clean_error(refuse(device), 2, f"{device} is a device, not a regular file",
                       "--context -")


def test_a_fifo_is_refused_up_front_not_waited_on(refuse, tmp_path):
    # a FIFO with no writer blocked the host in open(); process substitution is one too
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    res = refuse(str(fifo))
    assert_clean_error(res, 2, "is a FIFO, not a regular file", "pipe it into --context -")
    assert res.seconds < 30


def test_stdin_over_the_cap_is_refused_without_reading_it_all(refuse):
    res = refuse("-", "--max-context-bytes", "1000", input="y\n" * 1_500_000)
    assert_clean_error(res, 2, "stdin", "more than --max-context-bytes 1,000")


def test_an_empty_context_path_is_not_the_current_directory(refuse):
    assert_clean_error(refuse(""), 2, "empty path")


@pytest.mark.parametrize("path", [" ", "  two spaces", "tab\tin it", "trailing "])
def test_a_missing_path_with_spaces_is_shown_quoted(refuse, path):
    # shown as given, a lone space made the message end in blank space
    assert_clean_error(refuse(path), 2, "context file not found: " + re.escape(repr(path)))


# --------------------------------------------------------------------------- CLI: good input


def _run_ok(cli, srv, context: str, *extra: str, input=None):
    res = cli("run", "--context", context, "--query", "q?", "--no-journal", "-q",
              *endpoint_args(srv), *extra, input=input)
    assert res.rc == 0, res.stderr
    assert "Traceback" not in res.stderr
    return res.stdout.strip()


def test_latin1_file_with_encoding_flag(cli, scripted, tmp_path):
    text = "Le café est très bon. Ça va?\n"
    (tmp_path / "latin.txt").write_bytes(text.encode("latin-1"))
    srv = scripted(script([repl("FINAL(context.split()[1] + '|' + str(len(context)))")]))
    out = _run_ok(cli, srv, str(tmp_path / "latin.txt"), "--encoding", "latin-1")
    assert out == f"café|{len(text)}"


def test_json_dict_context(cli, scripted, tmp_path):
    (tmp_path / "data.json").write_text(json.dumps({"title": "Report", "pages": ["p1", "p2", "p3"]}))
    srv = scripted(script([repl("FINAL(type(context).__name__ + ':' + context['title'] + ':' "
                                "+ str(len(context['pages'])))")]))
    assert _run_ok(cli, srv, str(tmp_path / "data.json")) == "dict:Report:3"
    system = srv.requests[0]["messages"][0]["content"]
    assert "a dict" in system and "Report" not in system


def test_json_list_context(cli, scripted, tmp_path):
    (tmp_path / "docs.json").write_text(json.dumps(["first doc", "second doc", {"k": 1}]))
    srv = scripted(script([repl("FINAL(type(context).__name__ + ':' + str(len(context)) + ':' "
                                "+ context[1] + ':' + str(context[2]['k']))")]))
    assert _run_ok(cli, srv, str(tmp_path / "docs.json")) == "list:3:second doc:1"


def test_context_from_stdin(cli, scripted):
    srv = scripted(script([repl("FINAL(repr(context))")]))
    data = "piped in\nfrom stdin — ünïcode\n"
    out = _run_ok(cli, srv, "-", input=data)
    assert out == repr(data)


def test_a_stream_goes_through_stdin_not_a_named_pipe(cli, scripted, tmp_path):
    # a FIFO named as --context is refused (test above); the same stream piped into
    # --context - is read once, up to the cap, and its text handed over
    data = "through a pipe\n" * 1000
    srv = scripted(script([repl("FINAL(repr(context))")]))
    assert _run_ok(cli, srv, "-", input=data) == repr(data)


def test_utf8_bom_is_dropped(cli, scripted, tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeffhello bom".encode("utf-8"))
    srv = scripted(script([repl("FINAL(repr(context))")]))
    assert _run_ok(cli, srv, str(tmp_path / "bom.txt")) == repr("hello bom")


# --------------------------------------------------------------------------- load_context (no kernel)


def _load(source, **kw):
    """load_context, removing the temporary file it may write (the caller owns it)."""
    ctx = load_context(source, **kw)
    if ctx.owned and ctx.path:
        Path(ctx.path).unlink()
    return ctx


def test_load_context_values_and_paths(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("file text")
    # a str is the context itself, even when it names an existing file
    assert _load(str(p)).value == str(p)
    assert _load(p).value == "file text"
    assert _load(["a", "b"]).value == ["a", "b"]
    assert _load({"k": [1]}).fmt == "json"
    assert _load(b"bytes ok").value == "bytes ok"


def test_a_value_from_outside_is_never_a_path_or_stdin(tmp_path, monkeypatch):
    """load_value (a cell's rlm() argument, a serve client's context): whatever a str looks
    like, it is the text; nothing is opened (a FIFO would hang this test, stdin would leak)."""
    import io
    import sys
    from rlm.context.load import Literal, load_value
    from rlm.serve.request import parse_request
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"STDIN-SECRET\n")))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "a.txt").write_text("file text")
    for text in ("-", "/etc/passwd", "/dev/zero", str(fifo), str(tmp_path / "*.txt"),
                 str(tmp_path), "~/.netrc"):
        ctx = load_value(text)
        assert ctx.value == text and ctx.source == "<value>", (text, ctx.value)
        ctx.discard()
    data = load_value(["-", {"k": "/etc/passwd"}])
    assert data.value == ["-", {"k": "/etc/passwd"}]
    data.discard()
    for bad in (Path("/etc/passwd"), [Path("/etc/passwd")], {"k": Path("x")}, b"-", 3):
        with pytest.raises(ContextError, match="must be a str, a list or a JSON object"):
            load_value(bad)
    # serve: a client's context, given or taken from its messages, is a value too
    for body in ({"messages": [{"role": "user", "content": "q"}], "context": "-"},
                 {"messages": [{"role": "system", "content": "-"},
                               {"role": "user", "content": "q"}]}):
        req = parse_request(body)
        assert isinstance(req.context, Literal)
        assert _load(req.context).value == "-"
    assert sys.stdin.read() == "STDIN-SECRET\n"  # nobody read it


@pytest.mark.parametrize("value,needle", [("", "empty"), ("   \n", "empty"), (b"\x00\x01", "binary"),
                                          (b"caf\xe9", "not valid utf-8"), (3.5, "must be a str"),
                                          ({"k": object()}, "JSON-like")])
def test_load_context_refuses(value, needle):
    with pytest.raises(rlm.ContextError, match=f"(?i){needle}"):
        _load(value, encoding="utf-8")


def test_undecodable_bytes_past_the_first_64k_are_refused(tmp_path):
    p = tmp_path / "late-nul.txt"
    p.write_bytes(b"a" * 70000 + b"\xff\x00")
    with pytest.raises(rlm.ContextError):
        _load(p)


def test_json_scalar_becomes_text(tmp_path):
    p = tmp_path / "s.json"
    p.write_text('"just a string"')
    ctx = _load(p)
    assert ctx.value == "just a string" and ctx.fmt == "text"


def test_describe_gives_sizes_not_content():
    d = describe({"a": "xx", "b": [1, 2]})
    assert d["type"] == "dict" and d["items"] == 2 and d["item_chars"] == {"a": 2, "b": 6}
    d = describe(["abc", "de"])
    assert d["item_chars"] == [3, 2] and d["chars"] == 5
    assert describe("hello")["chars"] == 5


def test_api_refuses_bad_path_before_starting_anything(tmp_path, scripted):
    srv = scripted(_never)
    with pytest.raises(rlm.ContextError, match="not found"):
        rlm.completion(Path(tmp_path / "missing.txt"), "q", base_url=srv.base_url,
                       api_key="k", model="m", journal=False)
    assert srv.count == 0


def test_replay_of_a_latin1_run(cli, scripted, tmp_path):
    """A run whose context needed --encoding latin-1 can be replayed from the journal."""
    (tmp_path / "latin.txt").write_bytes("Le café est très bon.\n".encode("latin-1"))
    srv = scripted(script([repl("FINAL(context.split()[1])")]))
    first = cli("run", "--context", str(tmp_path / "latin.txt"), "--query", "q", "--encoding",
                "latin-1", "--run-id", "latin-run", *endpoint_args(srv))
    assert first.rc == 0, first.stderr
    assert first.stdout.strip() == "café"
    rp = cli("replay", "latin-run")
    assert rp.rc == 0, rp.stderr
    assert rp.stdout.strip() == "café"
    assert srv.count == 1


# --------------------------------------------------------------------------- the kernel's text and its hash

#: (context given, the text the kernel must see): line endings, a BOM character, characters
#: beyond the BMP, surrogates (the text policy), bytes (UTF-8, with a BOM, UTF-16)
UNUSUAL_TEXTS = [
    ("plain ascii\n", "plain ascii\n"),
    ("crlf\r\nand a lone cr\rkept\r\n", "crlf\r\nand a lone cr\rkept\r\n"),
    ("\ufeffa leading BOM character is text", "\ufeffa leading BOM character is text"),
    ("non-BMP \U0001f600, latin é, cjk \u4e2d", "non-BMP \U0001f600, latin é, cjk \u4e2d"),
    ("half an emoji \ud83d here", "half an emoji \ufffd here"),
    ("a pair \ud83d\ude00 as two code points", "a pair \U0001f600 as two code points"),
    (b"utf-8 bytes caf\xc3\xa9", "utf-8 bytes café"),
    (b"\xef\xbb\xbfbytes with a BOM", "bytes with a BOM"),
    (b"\xff\xfe" + "utf-16 \u4e2d".encode("utf-16-le"), "utf-16 \u4e2d"),
]


#: big enough to be written and hashed behind, on a thread (rlm.context.load._write_text)
BIG_TEXTS = [
    # ASCII: encoded piece by piece on that thread (two whole pieces and a part)
    ("a" * (9 << 20) + "tail\n", "a" * (9 << 20) + "tail\n"),
    ("x" * (3 << 20) + "\u00e9\U0001f600\n", "x" * (3 << 20) + "\u00e9\U0001f600\n"),
    ("y" * (2 << 20) + "\udc80", "y" * (2 << 20) + "\ufffd"),
    (b"caf\xc3\xa9 " * (1 << 18), "caf\u00e9 " * (1 << 18)),  # UTF-8 bytes, written as given
]


@pytest.mark.parametrize("value,text", UNUSUAL_TEXTS + BIG_TEXTS)
def test_text_context_file_and_hash_are_its_utf8(value, text):
    ctx = load_context(value)
    try:
        ctx.settle()  # a big one's file is written behind
        assert not ctx.writing
        data = Path(ctx.path).read_bytes()
        assert ctx.owned and ctx.fmt == "text"
        assert ctx.value == text
        assert data == text.encode("utf-8")
        assert ctx.sha256 == hashlib.sha256(data).hexdigest()
    finally:
        ctx.discard()
    assert not Path(ctx.path).exists()


@pytest.mark.parametrize("size", [100, 3 << 20])
def test_a_str_subclass_context_is_its_text_not_what_its_methods_say(size):
    class Odd(str):
        def encode(self, *a, **k):
            return b"xx"

        def __len__(self):
            return 2

    text = "t" * size
    ctx = load_context(Odd(text))
    try:
        ctx.settle()
        assert type(ctx.value) is str and ctx.value == text
        assert Path(ctx.path).read_bytes() == text.encode()
        assert ctx.sha256 == hashlib.sha256(text.encode()).hexdigest()
    finally:
        ctx.discard()


def test_text_context_without_surrogates_is_not_copied():
    value = "a context " * 1000 + "\u4e2d"
    ctx = load_context(value)
    ctx.discard()
    assert ctx.value is value


def test_an_ascii_text_is_written_from_its_own_bytes():
    """A big ASCII str is hashed and written from the bytes the string object holds (no
    encoded copy); where those cannot be had, None, and the text is encoded instead."""
    from rlm.context.files import ascii_buffer as _ascii_buffer

    text = "".join(chr(32 + i % 95) for i in range(100_000)) + "\n"
    view = _ascii_buffer(text)
    assert view is not None and view.readonly and view.tobytes() == text.encode("ascii")

    class Sub(str):
        pass

    for other in ("caf\u00e9 " * 1000, "\U0001f600" * 10, "", Sub("plain ascii")):
        assert _ascii_buffer(other) is None


@pytest.mark.parametrize("times", [1, 200_000])  # the big one is hashed behind
def test_text_file_read_in_place_is_hashed_from_its_bytes(tmp_path, times):
    p = tmp_path / "t.txt"
    p.write_bytes(("in place, caf\u00e9\r\n" * times).encode("utf-8"))
    ctx = load_context(p)
    assert not ctx.owned and ctx.path == str(p)
    assert ctx.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
    assert ctx.sha256 == hashlib.sha256(ctx.value.encode("utf-8")).hexdigest()


def test_kernel_context_and_recorded_hash_match_the_text(scripted, tmp_path):
    """The kernel's ``context`` is exactly the text (after the text policy) and the run's
    journal records the sha256 of that text's UTF-8 bytes, for every unusual text."""
    code = ("import hashlib, json\n"
            "FINAL(json.dumps([context, hashlib.sha256(context.encode('utf-8')).hexdigest()]))")
    srv = scripted(lambda req: repl(code))
    journal = str(tmp_path / "j.sqlite3")
    for i, (value, text) in enumerate(UNUSUAL_TEXTS):
        res = rlm.completion(value, "q", base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                             journal=journal, run_id=f"text-{i}")
        assert res.status == "completed", res.reason
        seen, seen_hash = json.loads(res.answer)
        want = hashlib.sha256(text.encode("utf-8")).hexdigest()
        assert seen == text and seen_hash == want
        with Journal(journal) as j:
            assert j.get_run(f"text-{i}")["options"]["context_sha256"] == want


@pytest.mark.parametrize("journal", [True, False])
def test_big_text_contexts_reach_the_kernel_whole_and_hashed(scripted, tmp_path, journal):
    """A big context's file is written behind while the run sets up: the kernel still sees
    the whole text, and the journal records the hash of all of it."""
    code = ("import hashlib, json\n"
            "FINAL(json.dumps([len(context), context[-40:], "
            "hashlib.sha256(context.encode('utf-8')).hexdigest()]))")
    srv = scripted(lambda req: repl(code))
    path = str(tmp_path / "j.sqlite3")
    for i, (value, text) in enumerate(BIG_TEXTS):
        res = rlm.completion(value, "q", base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                             journal=path if journal else False, run_id=f"big-{i}")
        assert res.status == "completed", res.reason
        want = hashlib.sha256(text.encode("utf-8")).hexdigest()
        assert json.loads(res.answer) == [len(text), text[-40:], want]
        if journal:
            with Journal(path) as j:
                assert j.get_run(f"big-{i}")["options"]["context_sha256"] == want


@pytest.fixture
def full_dir(tmp_path):
    """A directory on a real 256 KiB filesystem (tmpfs; needs root): a disk that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("value", ["z" * (3 << 20), "\u00e9" * (2 << 20), "small " * 100_000,
                                   ["a JSON list"] * 60_000, {"k": "v" * 600_000}])
def test_a_context_write_that_fills_the_disk_is_an_error_naming_the_file(full_dir, value):
    """Written behind or not, a context whose scratch file does not fit raises ContextError
    (an RLMError; errno ENOSPC) naming the file, leaves nothing behind, and says so again if
    asked again."""
    with pytest.raises(ContextError) as caught:
        ctx = load_context(value, scratch_dir=str(full_dir))
        ctx.settle()
    assert caught.value.errno == errno.ENOSPC
    assert re.search(r"No space left on device \(" + re.escape(str(full_dir)) + "/rlm-ctx-",
                     str(caught.value)), str(caught.value)
    assert list(full_dir.iterdir()) == []
    if "ctx" in locals():  # written behind: the error stays with the context
        with pytest.raises(ContextError):
            ctx.sha256
        ctx.discard()  # never raises


def _full_disk_sources(tmp_path: Path) -> dict:
    """Contexts whose scratch file does not fit in 256 KiB: (argv, stdin) per kind."""
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "a.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 120_000)
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(["x" * 100] * 6000).encode())
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(b"gz text " * 80_000))
    return {"stdin, written behind": (["--context", "-"], "w" * (3 << 20)),
            "a directory's converted file": (["--context", str(tmp_path / "latin1")], None),
            "a JSON file rewritten": (["--context", str(tmp_path / "bom.json")], None),
            "a decompressed file": (["--context", str(tmp_path / "t.txt.gz")], None)}


@pytest.mark.parametrize("kind,journal", [
    ("stdin, written behind", []), ("stdin, written behind", ["--no-journal"]),
    ("a directory's converted file", []), ("a JSON file rewritten", []),
    ("a decompressed file", [])])
def test_rlm_run_on_a_full_disk_says_so_and_journals_nothing(full_dir, scripted, cli, tmp_path,
                                                             kind, journal):
    srv = scripted(lambda req: repl("FINAL('unreachable')"))
    argv, stdin = _full_disk_sources(tmp_path)[kind]
    r = cli("run", *argv, "--query", "q", *endpoint_args(srv), *journal, input=stdin,
            env={"TMPDIR": str(full_dir)})
    assert_clean_error(r, 2, "no space left", re.escape(str(full_dir)) + "/rlm-ctx-")
    assert list(full_dir.iterdir()) == []
    assert not srv.requests  # nothing was sent
    if not journal:
        with Journal(str(cli.journal)) as j:
            assert j.list_runs() == []


def test_kernel_reads_text_files_exactly(tmp_path):
    """The kernel's reader (a memory map, or a plain read for what cannot be mapped): the
    file's text exactly, an empty file as "", and bytes that are not UTF-8 refused."""
    from kernels.runtime import load_context as kernel_load

    text = "\ufeffBOM kept, crlf\r\nkept, \U0001f600\n" * 1000
    (tmp_path / "t.txt").write_bytes(text.encode("utf-8"))
    assert kernel_load(str(tmp_path / "t.txt"), "text") == text
    (tmp_path / "empty.txt").write_bytes(b"")
    assert kernel_load(str(tmp_path / "empty.txt"), "text") == ""
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError):
        kernel_load(str(tmp_path / "bad.txt"), "text")


def test_decoding_applies_the_text_policy_only_where_surrogates_can_come_from():
    # strict UTF-8 never yields a surrogate (an encoded one is invalid), so UTF-8 text is not
    # scanned again; a codec that can yield one (utf-7) gets the policy
    with pytest.raises(rlm.ContextError, match="not valid utf-8"):
        formats.decode(b"half \xed\xa0\xbd emoji", "<t>", "utf-8")
    assert formats.decode("caf\u00e9 \U0001f600".encode(), "<t>", None) == (
        "caf\u00e9 \U0001f600", None)
    assert formats.decode(b"a +2D0- b", "<t>", "utf-7") == ("a \ufffd b", None)


def test_a_kernel_copy_of_the_context_on_a_full_disk_fails_the_run_naming_it(full_dir, scripted,
                                                                             cli, tmp_path):
    """A file read in place that the kernel's user may not read is copied into the kernel's
    directory (root host): on a full disk that copy fails the run with the copy named, not
    as an internal error and not under the user's own file's name."""
    if os.geteuid() != 0:
        pytest.skip("the kernel runs as the host's own user: nothing is copied")
    src = tmp_path / "private" / "in-place.txt"
    src.parent.mkdir(mode=0o700)
    src.write_text("a line of text\n" * 40_000)
    srv = scripted(lambda req: repl("FINAL('unreachable')"))
    r = cli("run", "--context", str(src), "--query", "q", "--run-id", "copy-1",
            *endpoint_args(srv), env={"TMPDIR": str(full_dir)})
    assert_clean_error(r, 2, "no space left", re.escape(str(full_dir)) + r"/\S+in-place\.txt",
                       "free space in " + re.escape(str(full_dir)) + " or")
    with Journal(str(cli.journal)) as j:
        run = j.get_run("copy-1")
    assert run["status"] == "failed" and "internal error" not in run["error"], run
    assert "could not write the context for the kernel" in run["error"]


def test_a_file_read_in_place_is_checked_unchanged_before_the_kernel_reads_it(tmp_path):
    p = tmp_path / "in-place.txt"
    p.write_text("the text the journal hashes\n" * 100)
    ctx = load_context(p)
    assert not ctx.owned and ctx.stamp == (p.stat().st_size, p.stat().st_mtime_ns)
    ctx.check_unchanged()  # nothing changed
    with open(p, "r+b") as f:  # the same size, other bytes (and a newer modification time)
        f.write(b"THE")
    os.utime(p, ns=(p.stat().st_atime_ns, ctx.stamp[1] + 1_000_000))
    with pytest.raises(ContextError, match="changed since it was loaded"):
        ctx.check_unchanged()
    p.write_text("shorter")
    with pytest.raises(ContextError, match="changed since it was loaded"):
        ctx.check_unchanged()


def test_the_kernel_refuses_a_context_file_of_another_size_than_loaded(tmp_path):
    from kernels.bundle import ContextChanged
    from kernels.runtime import load_context as kernel_load

    (tmp_path / "t.txt").write_text("twelve bytes")
    (tmp_path / "t.json").write_text('["json"]')
    assert kernel_load(str(tmp_path / "t.txt"), "text", 12) == "twelve bytes"
    assert kernel_load(str(tmp_path / "t.json"), "json", 8) == ["json"]
    for name, fmt in (("t.txt", "text"), ("t.json", "json")):
        with pytest.raises(ContextChanged, match="changed since it was loaded"):
            kernel_load(str(tmp_path / name), fmt, 5)


def test_a_run_whose_context_file_changes_before_the_kernel_reads_it_fails_as_bad_input(
        scripted, tmp_path):
    """The file changes after it was hashed (here from a listener, as the run's first stage
    opens): the run fails with a ContextError, never answers from other text than its
    journal records."""
    p = tmp_path / "in-place.txt"
    p.write_text("the text the journal hashes\n" * 100)
    srv = scripted(lambda req: repl("FINAL(str(len(context)))"))

    def change(event):
        if p.stat().st_size > 10:
            p.write_text("other")

    with pytest.raises(ContextError, match="changed since it was loaded") as caught:
        rlm.completion(p, "q", base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                       journal=str(tmp_path / "j.sqlite3"), run_id="changed-1",
                       listeners=[change])
    assert caught.value.result.status == "failed"
    with Journal(str(tmp_path / "j.sqlite3")) as j:
        assert "changed since it was loaded" in j.get_run("changed-1")["error"]


def test_bytes_in_a_detected_encoding_carry_the_note_a_file_would():
    raw = ("Gr\u00fc\u00dfe aus M\u00fcnchen, sch\u00f6ne Gr\u00f6\u00dfe\n" * 500).encode("cp1252")
    text, detected = formats.decode(raw, "<bytes>", None)
    assert detected
    ctx = load_context(raw)
    try:
        assert ctx.value == text
        assert describe(ctx)["note"] == f"It holds text decoded from bytes as {detected} (detected)."
    finally:
        ctx.discard()
    utf8 = load_context("plain UTF-8 text".encode())
    assert "note" not in describe(utf8)
    utf8.discard()


def test_a_private_copy_of_a_file_rewritten_while_copied_is_refused(tmp_path):
    """The kernel's private copy (root host) is checked once made: the user's file rewritten
    at the same size while it was copied would otherwise reach the kernel unnoticed."""
    import shutil

    p = tmp_path / "in-place.txt"
    p.write_text("the text the journal hashes\n" * 100)

    class CopyingKernel:
        def __init__(self, rewrite: bool) -> None:
            self.rewrite = rewrite

        def share_file(self, path, fmt, move=False):
            dest = str(tmp_path / "kernel-copy.txt")
            shutil.copyfile(path, dest)
            if self.rewrite:  # the same size, other bytes, a newer modification time
                with open(path, "r+b") as f:
                    f.write(b"THE")
                st = os.stat(path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
            return dest

    ctx = load_context(p)
    assert ctx.share(CopyingKernel(rewrite=False)) == str(tmp_path / "kernel-copy.txt")
    with pytest.raises(ContextError, match="changed since it was loaded"):
        ctx.share(CopyingKernel(rewrite=True))
