"""Contexts as users have them: a directory (a small repository made here), globs, several
paths, a mapping, and the formats inside them (.gz, .jsonl, .csv, .tsv, PDF, HTML, other
encodings). The model's code runs in a real kernel and reports what it sees; the assertions
check the exact keys and values, what the system prompt says, and the refusals (exit 2)."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import rlm
from conftest import API_KEY, MODEL, Reply, assert_clean_error, endpoint_args, repl, script
from rlm.context.load import describe, load_context
from rlm.context.sources import describe_files

FRENCH = ("Le café est très bon. Où est la bibliothèque? Les élèves étudient à l'école près "
          "de la forêt, et ça leur plaît beaucoup.\n")


def make_pdf(pages: list[str]) -> bytes:
    """A minimal valid PDF with one line of Helvetica text per page."""
    n = len(pages)
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>",
            ("<< /Type /Pages /Kids [%s] /Count %d >>"
             % (" ".join(f"{4 + 2 * i} 0 R" for i in range(n)), n)).encode(),
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for i, text in enumerate(pages):
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
        objs.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources "
                    f"<< /Font << /F1 3 0 R >> >> /Contents {5 + 2 * i} 0 R >>".encode())
        objs.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, o in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + o + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % off for off in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


def _write(root: Path, rel: str, data: bytes | str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


#: the keys a walk of the repository below must produce, in order
REPO_KEYS = ["README.md", "data/events.jsonl", "data/table.csv", "data/units.tsv",
             "docs/guide.html", "docs/report.pdf", "latin.txt", "logs/app.log.gz",
             "src/app.py", "src/lib/__init__.py", "src/lib/util.py"]


@pytest.fixture
def repo(tmp_path) -> Path:
    """A small repository: nested dirs, a .gitignore, binaries, and one file per format."""
    r = tmp_path / "repo"
    _write(r, "README.md", "# Demo\nA small project.\n")
    _write(r, "src/app.py", "from lib.util import add\nprint(add(2, 3))\n")
    _write(r, "src/lib/__init__.py", "")
    _write(r, "src/lib/util.py", "def add(a, b):\n    return a + b\n")
    _write(r, "docs/guide.html", "<html><head><title>Guide</title><style>p {color: red}</style>"
           "</head><body><h1>Install</h1><p>Run <b>make</b> &amp; wait.</p>"
           "<script>alert(1)</script></body></html>")
    _write(r, "docs/report.pdf", make_pdf(["Revenue was 42 million.", "Costs fell by 3 percent."]))
    _write(r, "data/events.jsonl", '{"id": 1, "kind": "start"}\n\n{"id": 2, "kind": "stop"}\n')
    _write(r, "data/table.csv", "name,qty\nbolt,10\nnut,25\n")
    _write(r, "data/units.tsv", "unit\tfactor\nkm\t1000\n")
    _write(r, "logs/app.log.gz", gzip.compress(b"12:00 boot\n12:01 OOM kill pid 7\n"))
    _write(r, "latin.txt", FRENCH.encode("cp1252"))
    _write(r, "logo.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(40))
    _write(r, "firmware.img", b"\x7fELF\x02\x01\x01\x00" + bytes(100))
    _write(r, ".gitignore", "build/\n*.tmp\n")
    _write(r, "build/out.txt", "generated\n")
    _write(r, "notes.tmp", "scratch\n")
    _write(r, ".git/config", "[core]\n")
    _write(r, ".env", "SECRET=1\n")
    _write(r, "venv/pyvenv.cfg", "home = /usr/bin\n")
    _write(r, "venv/lib/site.py", "x = 1\n")
    return r


def _ok(cli, srv, *args: str) -> str:
    res = cli("run", *args, "--query", "q?", "--no-journal", "-q", *endpoint_args(srv))
    assert res.rc == 0, res.stderr
    assert "Traceback" not in res.stderr
    return res.stdout.strip()


def _report(*expr_lines: str) -> str:
    """A scripted reply whose code builds ``out`` and answers with it as JSON."""
    return repl("import json", *expr_lines, "print(out)", "FINAL(json.dumps(out, sort_keys=True))")


def test_directory_context_sees_exact_keys_values_and_metadata(cli, scripted, repo):
    srv = scripted(script([_report(
        "out = {'type': type(context).__name__, 'keys': list(context),",
        "       'jsonl': context['data/events.jsonl'], 'csv': context['data/table.csv'],",
        "       'tsv': context['data/units.tsv'], 'pdf': context['docs/report.pdf'],",
        "       'html': context['docs/guide.html'], 'gz': context['logs/app.log.gz'],",
        "       'latin': context['latin.txt'], 'init': context['src/lib/__init__.py'],",
        "       'util': context['src/lib/util.py']}")]))
    out = json.loads(_ok(cli, srv, "--context", str(repo)))
    assert out["type"] == "dict"
    assert out["keys"] == REPO_KEYS
    assert out["jsonl"] == [{"id": 1, "kind": "start"}, {"id": 2, "kind": "stop"}]
    assert out["csv"] == [{"name": "bolt", "qty": "10"}, {"name": "nut", "qty": "25"}]
    assert out["tsv"] == [{"unit": "km", "factor": "1000"}]
    assert out["pdf"] == ["Revenue was 42 million.", "Costs fell by 3 percent."]
    assert out["html"] == "Guide\n\nInstall\n\nRun make & wait."
    assert out["gz"] == "12:00 boot\n12:01 OOM kill pid 7\n"
    assert out["latin"] == FRENCH
    assert out["init"] == "" and out["util"] == "def add(a, b):\n    return a + b\n"

    system = srv.requests[0]["messages"][0]["content"]
    # keys and sizes, the skipped files with sizes and why, what the rules left out, the notes
    for needle in ('"src/lib/util.py": 32', '"logo.png": "binary (.png), 56 bytes"',
                   '"firmware.img": "binary, 108 bytes"', "2 .gitignore (e.g. build/, notes.tmp)",
                   "1 virtualenv/cache directory (e.g. venv/)", "3 hidden",
                   "latin.txt: decoded as cp1252 (detected)", "logs/app.log.gz: decompressed from .gz",
                   "a list of records (JSON Lines) (data/events.jsonl)",
                   "a list of page texts (PDF) (docs/report.pdf)", "11 keys"):
        assert needle in system, needle
    # never the contents
    for secret in ("OOM kill", "Revenue", "return a + b", "SECRET", "bolt"):
        assert secret not in system


def test_include_and_exclude(cli, scripted, repo):
    srv = scripted(script([repl("FINAL(' '.join(context))")]))
    out = _ok(cli, srv, "--context", str(repo), "--include", "*.py", "--include", "docs/",
              "--exclude", "src/lib/")
    assert out.split() == ["docs/guide.html", "docs/report.pdf", "src/app.py"]
    system = srv.requests[0]["messages"][0]["content"]
    assert "not matching --include" in system and "--exclude (e.g. src/lib/__init__.py" in system


def test_glob_and_several_paths(cli, scripted, repo):
    _write(repo, "logs/db.log.gz", gzip.compress(b"db up\n"))
    srv = scripted(script([repl("import json", "FINAL(json.dumps(context, sort_keys=True))")] * 2))
    # a glob (quoted: the harness expands it): keys relative to the glob's fixed prefix
    out = _ok(cli, srv, "--context", str(repo / "logs" / "*.log.gz"))
    assert json.loads(out) == {"app.log.gz": "12:00 boot\n12:01 OOM kill pid 7\n",
                               "db.log.gz": "db up\n"}
    # several paths: keys relative to their common parent
    out = _ok(cli, srv, "--context", str(repo / "src" / "lib"), "--context", str(repo / "README.md"))
    assert sorted(json.loads(out)) == ["README.md", "src/lib/__init__.py", "src/lib/util.py"]


def test_empty_directory_exits_2(cli, scripted, tmp_path):
    srv = scripted(script([]))
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / ".hidden").write_text("x")
    res = cli("run", "--context", str(tmp_path / "nothing"), "--query", "q", *endpoint_args(srv))
    assert_clean_error(res, 2, "has no files to read", "1 hidden")
    assert srv.count == 0


def test_directory_of_binaries_exits_2(cli, scripted, tmp_path):
    srv = scripted(script([]))
    d = tmp_path / "bins"
    _write(d, "a.png", b"\x89PNG" + bytes(10))
    _write(d, "b.dat", b"\x00\x01\x02")
    _write(d, "c.zip", b"PK\x03\x04")
    res = cli("run", "--context", str(d), "--query", "q", *endpoint_args(srv))
    assert_clean_error(res, 2, "no text files", r"3 file\(s\) skipped", "a.png", "archive")
    assert srv.count == 0


def test_size_cap_names_the_biggest_files(cli, scripted, tmp_path):
    srv = scripted(script([]))
    d = tmp_path / "big"
    _write(d, "logs/huge.log", "x" * 6000)
    _write(d, "logs/mid.log", "x" * 3000)
    _write(d, "small.txt", "x" * 100)
    res = cli("run", "--context", str(d), "--query", "q", "--max-context-bytes", "5000",
              *endpoint_args(srv))
    assert_clean_error(res, 2, "over --max-context-bytes 5,000", "logs/huge.log 6.0 KB",
                       r"logs/ 9.0 KB \(2 files\)", "--exclude")
    # a compressed file that grows past the cap is caught while decompressing
    _write(tmp_path / "bomb", "z.log.gz", gzip.compress(b"y" * 50_000))
    res = cli("run", "--context", str(tmp_path / "bomb"), "--query", "q", "--max-context-bytes",
              "5000", *endpoint_args(srv))
    assert_clean_error(res, 2, "over --max-context-bytes", "z.log.gz")
    # its size is only known to be more than what was read: said so, not "is 5.0 KB"
    assert "is more than 5.0 KB" in res.stderr and "z.log.gz more than" in res.stderr, res.stderr
    # the same for one compressed file given alone
    res = cli("run", "--context", str(tmp_path / "bomb" / "z.log.gz"), "--query", "q",
              "--max-context-bytes", "5000", *endpoint_args(srv))
    assert_clean_error(res, 2, "z.log.gz is more than 5.0 KB, over --max-context-bytes 5,000")
    assert srv.count == 0


@pytest.mark.parametrize("n, shown", [(999, "999 bytes"), (1000, "1.0 KB"), (999_949, "999.9 KB"),
                                      (999_997, "1.0 MB"), (1_000_000, "1.0 MB"),
                                      (999_960_000, "1.0 GB")])
def test_sizes_never_read_1000_of_a_unit(n, shown):
    from rlm.context.sources import _human
    assert _human(n) == shown


def test_api_path_list_and_mapping_and_replay(scripted, repo, tmp_path):
    journal = tmp_path / "j.sqlite3"
    code = repl("import json", "FINAL(json.dumps({k: (v if isinstance(v, str) else len(v)) "
                "for k, v in context.items()}, sort_keys=True))")
    srv = scripted(script([code] * 4))
    o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL)
    first = rlm.completion(repo / "src", "q", journal=str(journal), run_id="dir-run", **o)
    assert json.loads(first.answer) == {"app.py": "from lib.util import add\nprint(add(2, 3))\n",
                                      "lib/__init__.py": "", "lib/util.py":
                                      "def add(a, b):\n    return a + b\n"}
    res = rlm.completion([repo / "README.md", repo / "data" / "table.csv"], "q", journal=False, **o)
    assert json.loads(res.answer) == {"README.md": "# Demo\nA small project.\n",
                                      "data/table.csv": 2}
    res = rlm.completion({"notes": "typed here", "report": repo / "docs" / "report.pdf"}, "q",
                         journal=False, **o)
    assert json.loads(res.answer) == {"notes": "typed here", "report": 2}
    res = rlm.completion(repo, "q", journal=False, include=["*.md"], **o)
    assert json.loads(res.answer) == {"README.md": "# Demo\nA small project.\n"}
    assert srv.count == 4
    # the directory run replays from the journal (its sources are recorded); then an edited
    # file is a divergence
    rp = rlm.api.replay("dir-run", journal=str(journal))
    assert rp.answer == first.answer and rp.replayed_calls == 1
    assert srv.count == 4
    (repo / "src" / "app.py").write_text("changed\n")
    with pytest.raises(rlm.DivergenceError, match="changed"):
        rlm.api.replay("dir-run", journal=str(journal))


def test_a_failed_directory_run_resumes_with_its_sources_and_filters(scripted, repo, tmp_path):
    """Resume rebuilds the same dict from the recorded paths and filters: the first call is
    served from the journal, so its request (and the prompt's listing) hash the same."""
    journal = tmp_path / "j.sqlite3"
    code = repl("import json", "FINAL(json.dumps(sorted(context)))")
    fail = {"on": True}

    def root(req):
        return Reply(status=503, content="down") if fail["on"] else code

    srv = scripted(script([repl("n = len(context)", "print(n)"), root, root]))
    o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=str(journal))
    with pytest.raises(rlm.EndpointError):
        rlm.completion(repo, "q", run_id="dir-resume", include=["src/"], exclude="__init__.py",
                       max_attempts=1, **o)
    rec = rlm.config.records.open_journal(str(journal)).get_run("dir-resume")
    spec = rec["options"]["context_spec"]
    assert rec["options"]["context_source"] is None and spec["sources"] == [str(repo)]
    assert (spec["include"], spec["exclude"]) == (["src/"], ["__init__.py"])
    fail["on"] = False
    res = rlm.api.resume("dir-resume", **o)
    assert res.status == "completed" and res.replayed_calls == 1
    assert json.loads(res.answer) == ["src/app.py", "src/lib/util.py"]


def test_surrogates_in_many_file_contexts_become_replacement_characters(tmp_path):
    """The text policy (harness/text.py) holds for every file and value of a bundle."""
    _write(tmp_path / "d", "r.jsonl", '{"x": "half \\ud83d an emoji"}\n')
    _write(tmp_path / "d", "ok.txt", "fine\n")
    ctx = load_context(tmp_path / "d")
    assert _value(ctx) == {"ok.txt": "fine\n", "r.jsonl": [{"x": "half \ufffd an emoji"}]}
    ctx = load_context({"k\udc80": "v\ud83d", "f": tmp_path / "d" / "ok.txt"})
    # a key's escaped byte (as os.fsdecode gives a name's) is written \x80: see docs/contexts.md
    assert _value(ctx) == {"k\\x80": "v\ufffd", "f": "fine\n"}
    one = load_context(tmp_path / "d" / "r.jsonl")
    assert _value(one) == [{"x": "half \ufffd an emoji"}]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="unprivileged kernels need a root host")
def test_an_unprivileged_kernel_reads_what_it_may_in_place_and_copies_the_rest(tmp_path):
    from kernels import sandbox
    from kernels.bundle import read_bundle
    ident = sandbox.Identity(65534, 65534, "nobody")
    base = Path(tempfile.mkdtemp(prefix="rlm-share-"))
    try:
        os.chmod(base, 0o755)
        _write(base / "d", "open.txt", "anyone\n")
        _write(base / "d", "closed/secret.txt", "root only\n")
        _write(base / "d", "rows.csv", "a\n1\n")
        os.chmod(base / "d", 0o755)
        os.chmod(base / "d" / "open.txt", 0o644)
        os.chmod(base / "d" / "closed", 0o700)
        work = base / "work"
        work.mkdir()
        ctx = load_context(base / "d")
        shared = sandbox.share_bundle(ctx.path, str(work), ident)
        files = [e[1] for e in json.loads(Path(shared).read_text())["entries"]]
        assert files[1] == str(base / "d" / "open.txt")  # read in place
        assert all(f.startswith(str(work)) for f in (files[0], files[2]))  # closed dir, scratch
        for f in [shared, files[0], files[2]]:
            st = os.stat(f)
            assert (st.st_uid, st.st_mode & 0o777) == (65534, 0o400)
        assert read_bundle(shared) == _value(ctx)
        assert sandbox.share_bundle(ctx.path, str(work), None) == ctx.path
    finally:
        shutil.rmtree(base, ignore_errors=True)



@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")
def test_share_file_moves_or_copies_into_a_private_file():
    """A kernel running as another user gets a file of its own, read-only: a copy of a file
    the host keeps, or the host's temporary file itself, moved (none left behind)."""
    from kernels import sandbox
    ident = sandbox.Identity(65534, 65534, "nobody")
    base = Path(tempfile.mkdtemp(prefix="rlm-share-"))
    try:
        work = base / "work"
        work.mkdir()
        keep, temp = base / "keep.txt", base / "temp.txt"
        keep.write_text("the user's file\n")
        temp.write_text("the host's temporary file\n")
        copied = sandbox.share_file(str(keep), str(work), ident)
        moved = sandbox.share_file(str(temp), str(work), ident, move=True)
        assert keep.read_text() == Path(copied).read_text() == "the user's file\n"
        assert not temp.exists() and Path(moved).read_text() == "the host's temporary file\n"
        for f in (copied, moved):
            st = os.stat(f)
            assert Path(f).parent == work and (st.st_uid, st.st_mode & 0o777) == (65534, 0o400)
        assert sandbox.share_file(str(keep), str(work), None, move=True) == str(keep)
        assert keep.exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)

# --------------------------------------------------------------------------- no kernel


def _value(ctx):
    try:
        return ctx.read_value()
    finally:
        ctx.discard()


def test_single_files_by_format(tmp_path, repo):
    ctx = load_context(repo / "data" / "events.jsonl")
    assert _value(ctx) == [{"id": 1, "kind": "start"}, {"id": 2, "kind": "stop"}]
    assert "JSON Lines records read from events.jsonl" in describe(ctx)["note"]
    assert _value(load_context(repo / "docs" / "report.pdf"))[1] == "Costs fell by 3 percent."
    assert _value(load_context(repo / "logs" / "app.log.gz")).startswith("12:00 boot")
    ctx = load_context(repo / "latin.txt")
    assert _value(ctx) == FRENCH and "cp1252 (detected)" in describe(ctx)["note"]
    for name, data, needle in [("bad.jsonl", '{"a": 1}\nnot json\n', "line 2"),
                               ("bad.gz", b"not gzip at all", "not a valid .gz"),
                               ("scan.pdf", make_pdf([""]), "without a text layer"),
                               ("empty.csv", "", "empty")]:
        _write(tmp_path, name, data)
        with pytest.raises(rlm.ContextError, match=needle):
            load_context(tmp_path / name)


def test_pdf_without_the_extra(monkeypatch, repo):
    monkeypatch.setitem(sys.modules, "pypdf", None)  # import pypdf -> ImportError
    with pytest.raises(rlm.ContextError, match=r"pip install .*\[pdf\]'"):
        load_context(repo / "docs" / "report.pdf")
    ctx = load_context(repo / "docs")  # in a directory: skipped and listed, with the hint
    try:
        assert "[pdf]'" in describe(ctx)["listing"]
        assert [s["path"] for s in describe(ctx)["skipped"]] == ["report.pdf"]
    finally:
        ctx.discard()


def test_malformed_jsonl_in_a_directory_is_kept_as_text(tmp_path):
    _write(tmp_path / "d", "bad.jsonl", '{"a": 1}\n{oops\n')
    ctx = load_context(tmp_path / "d")
    assert _value(ctx) == {"bad.jsonl": '{"a": 1}\n{oops\n'}
    assert "kept as text: line 2" in ctx.meta["listing"]


def test_plain_text_is_read_in_place_and_hashed_by_streaming(tmp_path):
    d = tmp_path / "plain"
    _write(d, "a.txt", "alpha\n" * 1000)
    _write(d, "b/c.md", "ünïcode\n" * 1000)
    ctx = load_context(d)
    first = ctx.sha256
    assert ctx.extra_files == []  # no copy: the kernel reads the user's files
    entries = json.loads(Path(ctx.path).read_text())["entries"]
    assert [e[1] for e in entries] == [str(d / "a.txt"), str(d / "b" / "c.md")]
    assert _value(ctx) == {"a.txt": "alpha\n" * 1000, "b/c.md": "ünïcode\n" * 1000}
    assert load_context(d).sha256 == first
    (d / "a.txt").write_text("alpha\n" * 999 + "omega\n")
    assert load_context(d).sha256 != first


def test_thousands_of_files_are_summarised():
    info = {f"pkg{i % 30}/mod{i}.py": ("text", 1000 + i) for i in range(3000)}
    info.update({f"docs/page{i}.md": ("text", 50) for i in range(500)})
    meta = describe_files(info, origin="the directory /x",
                          skipped=[(f"img/{i}.png", 10, "binary (.png)") for i in range(40)])
    text = meta["listing"]
    assert len(text) < 4000
    assert "3,500 keys" in text and '"pkg29/": "100 files, 251,400 chars"' in text
    assert "and 16 more" in text  # 31 directories: the 15 biggest are named
    assert '".py": "3000 files' in text and "Largest (characters)" in text
    assert 'Not loaded because not text: 40 file(s) (400 bytes), by reason: {"binary (.png)": 40}' \
        in text and '"img/9.png"' in text and '"img/10.png"' not in text
