"""Contexts confined to what the user named (issue 25, item 2): in a directory, a glob or a
list of paths, a symlink out of the named roots, a FIFO, a socket or a device is not read but
listed with its reason; nothing the walk meets is dropped silently; symlink loops end; and on
a root host started through sudo, nothing the user who ran sudo may not read is copied (or
converted) for an unprivileged kernel.

Real files in ``tmp_path`` (real FIFOs, a real Unix socket), real runs of the CLI against
the scripted OpenAI server where the kernel's view matters."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

import rlm
from conftest import assert_clean_error, endpoint_args, repl, script
from rlm.context.load import load_context
from rlm.errors import ContextError

OUTSIDE = "symlink to a path outside the named roots"
SECRET = "TOPSECRET-credentials-4f1c"


@contextmanager
def deadline(seconds: float):
    """Fail (TimeoutError) if the block is still running after ``seconds``: a load that
    hangs (a FIFO opened with no writer, a glob lost in symlink loops) fails the test. The
    timer pytest-timeout may have set is restored after."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - t0), 0.001))


def _value(ctx):
    try:
        return ctx.read_value()
    finally:
        ctx.discard()


def _skipped(ctx) -> dict:
    return {s["path"]: s["reason"] for s in ctx.meta["skipped"]}


@pytest.fixture
def tree(tmp_path) -> Path:
    """``ctx/`` next to ``secret/credentials``: two symlinks out of it (to the secret and to
    /etc/shadow), one inside, and a plain file."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "credentials").write_text(SECRET + "\n")
    d = tmp_path / "ctx"
    (d / "sub").mkdir(parents=True)
    (d / "ok.txt").write_text("plain text\n")
    (d / "sub" / "real.txt").write_text("reached through an inside symlink\n")
    (d / "notes.txt").symlink_to("../secret/credentials")
    (d / "shadow.txt").symlink_to("/etc/shadow")
    (d / "inside.txt").symlink_to("sub/real.txt")
    return d


@contextmanager
def _socket_at(path: Path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
        s.listen(1)
        yield s
    finally:
        s.close()


# --------------------------------------------------------------------------- real runs


def test_symlinks_out_of_a_directory_never_reach_the_kernel_and_are_listed(cli, scripted, tree):
    srv = scripted(script([repl("import json", "print(json.dumps(context, sort_keys=True))",
                                "FINAL(json.dumps(context, sort_keys=True))")]))
    res = cli("run", "--context", str(tree), "--query", "q?", "--no-journal", "-q",
              *endpoint_args(srv))
    assert res.rc == 0, res.stderr
    seen = json.loads(res.stdout)
    assert seen == {"inside.txt": "reached through an inside symlink\n", "ok.txt": "plain text\n"}
    assert SECRET not in res.stdout + res.stderr
    system = srv.requests[0]["messages"][0]["content"]
    for key in ("notes.txt", "shadow.txt"):  # listed, with the reason, to the model
        assert f'"{key}": "{OUTSIDE}"' in system, system
    for req in srv.requests:  # nor in anything the model was sent (the cell's output)
        assert SECRET not in json.dumps(req) and "root:" not in json.dumps(req)


def test_the_loader_reads_neither_symlink_out_of_the_tree(tree):
    with deadline(30):
        ctx = load_context(tree)
    skipped = _skipped(ctx)
    assert skipped["notes.txt"] == skipped["shadow.txt"] == OUTSIDE
    assert skipped["notes.txt"] in ctx.meta["listing"]
    entries = json.loads(Path(ctx.path).read_text())["entries"]
    real = {os.path.realpath(e[1]) for e in entries}
    assert os.path.realpath(tree.parent / "secret" / "credentials") not in real
    assert "/etc/shadow" not in real
    value = _value(ctx)
    assert sorted(value) == ["inside.txt", "ok.txt"] and SECRET not in json.dumps(value)
    # the same through a glob, and through a glob that goes down the tree
    for pattern in (tree / "*.txt", tree / "**" / "*.txt"):
        with deadline(30):
            ctx = load_context(pattern)
        assert _skipped(ctx)["shadow.txt"] == OUTSIDE == _skipped(ctx)["notes.txt"]
        assert sorted(_value(ctx)) == ["inside.txt", "ok.txt"]


def test_a_fifo_and_a_socket_in_the_tree_are_listed_and_the_load_does_not_hang(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("alpha\n")
    os.mkfifo(d / "pipe")
    (d / "pipe-link").symlink_to("pipe")  # a FIFO through an inside symlink
    (d / "zero").symlink_to("/dev/zero")  # a device, out of the tree
    with _socket_at(d / "sock"):
        for source in (d, d / "*", [d / "a.txt", d / "pipe", d / "sock", Path("/dev/null")]):
            with deadline(30):
                ctx = load_context(source)
            skipped = _skipped(ctx)
            value = _value(ctx)
            assert [k.rsplit("/", 1)[-1] for k in value] == ["a.txt"], value
            named = {k.rsplit("/", 1)[-1]: r for k, r in skipped.items()}
            assert named["pipe"] == "a FIFO" and named["sock"] == "a socket", skipped
            if isinstance(source, list):  # named: a device is not read either
                assert named["null"] == "a device"
            else:
                assert named["pipe-link"] == "a FIFO" and named["zero"] == OUTSIDE
            assert "a FIFO" in ctx.meta["listing"] and "a socket" in ctx.meta["listing"]
    # a FIFO, a socket or a device named alone is refused before it is opened (a FIFO with
    # no writer used to hang the host), naming what it is and what to give instead
    fifo = tmp_path / "alone"
    os.mkfifo(fifo)
    with _socket_at(tmp_path / "alone.sock"):
        for path, what in ((fifo, "a FIFO"), (tmp_path / "alone.sock", "a socket"),
                           (Path("/dev/null"), "a device"), (Path("/dev/zero"), "a device"),
                           (d / "pipe-link", "a FIFO")):
            with deadline(30), pytest.raises(ContextError) as err:
                load_context(path)
            assert f"is {what}, not a regular file" in str(err.value), err.value
            assert "--context -" in str(err.value)


def test_an_inside_symlink_still_loads_and_nothing_is_dropped_silently(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "real.txt").write_text("real\n")
    (d / "alias.txt").symlink_to("sub/real.txt")  # a second key for one file
    (d / "docs").symlink_to("sub", target_is_directory=True)  # a symlinked directory, inside
    (d / "away").symlink_to(tmp_path, target_is_directory=True)  # ... and one leading out
    (d / "empty.txt").write_text("")
    (d / ".hidden").write_text("h\n")
    (d / "venv").mkdir()
    (d / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (d / ".gitignore").write_text("*.tmp\n")
    (d / "scratch.tmp").write_text("t\n")
    (d / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(20))
    (d / "drop.log").write_text("excluded\n")
    with deadline(30):
        ctx = load_context(d, exclude=["*.log"])
    listing, skipped = ctx.meta["listing"], _skipped(ctx)
    value = _value(ctx)
    assert value == {"alias.txt": "real\n", "empty.txt": ""}  # the inside symlink, read as ever
    assert skipped["docs/"] == "symlink to a directory (not followed)"
    assert skipped["away/"] == OUTSIDE
    assert "the same file as another key (e.g. sub/real.txt (= alias.txt))" in listing
    # every entry of the tree is a key or named in the listing
    for entry in sorted(os.listdir(d)):
        assert entry in value or any(entry in k for k in value) or entry in listing, entry


def test_a_symlink_loop_terminates_and_is_listed(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "ok.txt").write_text("ok\n")
    (d / "a").symlink_to("b")
    (d / "b").symlink_to("a")
    (d / "loop").symlink_to(".", target_is_directory=True)
    (d / "again").symlink_to(".", target_is_directory=True)  # two loops: 2**40 paths for glob
    for source in (d, d / "**" / "*.txt", d / "**"):
        with deadline(30):
            ctx = load_context(source)
        skipped = _skipped(ctx)
        assert _value(ctx) == {"ok.txt": "ok\n"}
        assert skipped["loop/"] == skipped["again/"] == "symlink to a directory (not followed)"
        if source == d:
            assert skipped["a"] == skipped["b"] == "a symlink loop"


def test_a_directory_of_nothing_but_links_out_names_them(cli, scripted, tmp_path):
    srv = scripted(script([]))
    d = tmp_path / "only-links"
    d.mkdir()
    (d / "shadow.txt").symlink_to("/etc/shadow")
    res = cli("run", "--context", str(d), "--query", "q", *endpoint_args(srv))
    assert_clean_error(res, 2, "has no files to read", "shadow.txt", OUTSIDE)
    assert srv.count == 0


# --------------------------------------------------------------------------- root, sudo


needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="unprivileged kernels and sudo need a root host")
SUDO = {"SUDO_UID": "4242", "SUDO_GID": "4242", "SUDO_USER": "alice"}


@pytest.fixture
def shared_dir():
    """A directory anyone may enter (not under pytest's root-only tmp): ``open.txt`` anyone
    may read, ``closed.txt`` only root, ``latin.txt`` (converted: a scratch file)."""
    base = Path(tempfile.mkdtemp(prefix="rlm-confined-"))
    try:
        os.chmod(base, 0o755)
        d = base / "d"
        d.mkdir()
        os.chmod(d, 0o755)
        (d / "open.txt").write_text("anyone may read this\n")
        os.chmod(d / "open.txt", 0o644)
        (d / "closed.txt").write_text(SECRET + "\n")
        os.chmod(d / "closed.txt", 0o600)
        (d / "latin.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e, tr\xe8s bon\n"
                                      .encode("cp1252"))
        os.chmod(d / "latin.txt", 0o644)
        yield d
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_root
def test_no_private_copy_of_a_file_the_sudo_user_may_not_read(shared_dir, monkeypatch):
    from kernels import sandbox
    monkeypatch.delenv("RLM_KERNEL_USER", raising=False)
    for k in SUDO:
        monkeypatch.delenv(k, raising=False)
    nobody = sandbox.Identity(65534, 65534, "nobody")
    work = shared_dir.parent / "work"
    work.mkdir()
    # loaded under root's own rights (no SUDO_UID): closed.txt is in the bundle
    ctx = load_context(shared_dir)
    assert SECRET in json.dumps(ctx.read_value())
    for k, v in SUDO.items():
        monkeypatch.setenv(k, v)
    assert sandbox.starting_user() == sandbox.Identity(4242, 4242, "alice")
    before = sorted(os.listdir(work))
    with pytest.raises(PermissionError) as err:
        sandbox.share_file(str(shared_dir / "closed.txt"), str(work), nobody)
    assert err.value.filename == str(shared_dir / "closed.txt")
    assert "alice (uid 4242), who started rlm through sudo, may not read it" in str(err.value)
    with pytest.raises(PermissionError, match="closed.txt"):
        sandbox.share_bundle(ctx.path, str(work), nobody)
    assert sorted(os.listdir(work)) == before  # no copy of it, nor of anything
    # what the user may read is copied; so are the host's own scratch files (the blob)
    copied = sandbox.share_file(str(shared_dir / "open.txt"), str(work), nobody)
    assert Path(copied).read_text() == "anyone may read this\n"
    ctx.discard()
    monkeypatch.delenv("SUDO_UID")
    ctx = load_context(shared_dir, exclude=["closed.txt"])
    monkeypatch.setenv("SUDO_UID", "4242")
    assert ctx.extra_files  # latin.txt, converted into a scratch file alice may not read
    from kernels.bundle import read_bundle
    shared = sandbox.share_bundle(ctx.path, str(work), nobody)
    assert read_bundle(shared) == _value(ctx)
    # without SUDO_UID, root's own rights apply
    monkeypatch.delenv("SUDO_UID")
    dest = sandbox.share_file(str(shared_dir / "closed.txt"), str(work), nobody)
    assert Path(dest).read_text() == SECRET + "\n"


@needs_root
def test_under_sudo_a_file_the_user_may_not_read_is_not_loaded(shared_dir, monkeypatch):
    monkeypatch.delenv("RLM_KERNEL_USER", raising=False)
    for k, v in SUDO.items():
        monkeypatch.setenv(k, v)
    ctx = load_context(shared_dir)
    reason = _skipped(ctx)["closed.txt"]
    assert reason.startswith("not readable by alice (uid 4242), who started rlm through sudo")
    assert "closed.txt" in ctx.meta["listing"]
    value = _value(ctx)
    assert sorted(value) == ["latin.txt", "open.txt"] and SECRET not in json.dumps(value)
    with pytest.raises(rlm.ContextError, match=r"closed.txt is not readable by alice \(uid 4242\)"):
        load_context(shared_dir / "closed.txt")
    assert _value(load_context(shared_dir / "open.txt")) == "anyone may read this\n"
    # kernels that run as root get no private copy: root's rights, as before
    monkeypatch.setenv("RLM_KERNEL_USER", "root")
    assert SECRET in json.dumps(_value(load_context(shared_dir)))


@needs_root
def test_a_sudo_run_gives_the_kernel_only_what_the_user_may_read(cli, scripted, shared_dir):
    srv = scripted(script([repl("import json", "FINAL(json.dumps(context, sort_keys=True))")]))
    res = cli("run", "--context", str(shared_dir), "--query", "q?", "--no-journal", "-q",
              *endpoint_args(srv), env=SUDO)
    assert res.rc == 0, res.stderr
    assert sorted(json.loads(res.stdout)) == ["latin.txt", "open.txt"]
    assert SECRET not in res.stdout + json.dumps(srv.requests)
    system = srv.requests[0]["messages"][0]["content"]
    assert '"closed.txt": "not readable by alice (uid 4242)' in system
    res = cli("run", "--context", str(shared_dir / "closed.txt"), "--query", "q",
              *endpoint_args(srv), env=SUDO)
    assert_clean_error(res, 2, "closed.txt is not readable by alice")
    assert SECRET not in res.stdout + res.stderr
