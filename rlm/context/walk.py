"""The walk of a many-file context: which files of the named roots (directories, globs, paths)
become keys and which are skipped, and why (``.gitignore``, hidden and virtualenv directories,
``include``/``exclude``, symlinks out of the roots, FIFOs, sockets and devices, files the user
who started ``rlm`` through sudo may not read). Every entry it meets ends up a key or a listed
skip. :mod:`rlm.context.sources` builds the bundle from what it collects."""
from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from harness.text import clean_text, has_surrogates

from rlm.errors import ContextError


DEFAULT_MAX_BYTES = 2_000_000_000
SKIP_DIRS = frozenset({"__pycache__", "node_modules"})
_MAGIC = re.compile(r"[*?\[]")
_CHUNK = 1 << 20

#: Why a path in a many-file context is not read: a symlink out of what the user named.
OUTSIDE = "symlink to a path outside the named roots"
#: ... a symlink to a directory (a walk never follows one).
LINKED_DIR = "symlink to a directory (not followed)"


@dataclass
class Bundle:
    """A built many-file context: ``manifest`` is the file the kernel binds from."""

    manifest: str
    blob: str | None
    sha256: str
    meta: dict
    entries: int
    origin: str


@dataclass
class _Walk:
    files: list = field(default_factory=list)          # (key, abs path)
    ignored: dict = field(default_factory=dict)        # why -> [count, examples]
    unread: list = field(default_factory=list)         # (key, reason): met, not read
    roots: list = field(default_factory=list)          # real paths of what the user named
    renamed: dict = field(default_factory=dict)        # key given -> the key it would have had

    def ignore(self, why: str, what: str) -> None:
        n = self.ignored.setdefault(why, [0, []])
        n[0] += 1
        if len(n[1]) < 4:
            n[1].append(what)

    def skip(self, what: str, reason: str) -> None:
        self.unread.append((what, reason))

    def inside(self, real: str) -> bool:
        """True if the real path ``real`` is one of the named roots or under one."""
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in self.roots)


def _kind(mode: int) -> str | None:
    """Why a file of this mode (``st_mode``, links followed) is not read; None: a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return LINKED_DIR
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def not_regular(mode: int, shown: str) -> None:
    """Refuse a file whose mode (``st_mode``, links followed) is not a regular file's.

    Raises:
        ContextError: naming ``shown``, what it is, and what to give instead.
    """
    why = _kind(mode)
    if why is not None:
        raise ContextError(f"context file {shown} is {why}, not a regular file: a context is "
                           "read from a file or a directory; to hand over a stream, pipe it "
                           "into --context - (stdin)")


def open_regular(path: str, shown: str | None = None):
    """Open ``path`` for reading (binary) only if it is a regular file when opened: the open
    itself cannot block (``O_NONBLOCK``: a FIFO swapped in after a check) and the opened file
    is checked, so nothing but a regular file is ever read. Returns a file object.

    Raises:
        ContextError: it is not a regular file (:func:`not_regular`).
        OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        not_regular(os.fstat(fd).st_mode, shown or path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _not_readable(full: str, w: _Walk, *, named: bool = False) -> str | None:
    """Why the file ``full`` met by a walk is not read, or None: a regular file inside the
    named roots (through a symlink too). ``named``: the user named this path itself (a
    symlink to anywhere is fine; it must still be a regular file)."""
    try:
        st = os.lstat(full)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        # a walk's entries sit in real directories below a root (walks and globs never go
        # through a symlinked directory): only a symlink can lead out
        if not named and not w.inside(os.path.realpath(full)):
            return OUTSIDE
        try:
            st = os.stat(full)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return "a symlink loop"
            if exc.errno == errno.ENOENT:
                return "a broken symlink (its target does not exist)"
            return f"cannot be read ({exc.strerror})"
    return _kind(st.st_mode)


def _linked_dir(full: str, w: _Walk) -> str:
    """Why the symlinked directory ``full`` is not walked."""
    return LINKED_DIR if w.inside(os.path.realpath(full)) else OUTSIDE


def _spec(patterns: Iterable[str]):
    import pathspec
    return pathspec.GitIgnoreSpec.from_lines([p for p in patterns if p and p.strip()])


def key_text(rel: str) -> str:
    """The key of a relative path (str, as ``os.fsdecode`` gives it: a byte that is not UTF-8
    is a surrogate U+DC80..U+DCFF): each such byte written as ``\\xHH`` (lower-case hex), the
    rest as is. ``caf\\xe9.txt`` (Latin-1 bytes) and ``caf\ufffd.txt`` (a real U+FFFD) stay two
    keys, and neither holds a surrogate (the text policy of :mod:`harness.text`)."""
    if not has_surrogates(rel):
        return rel
    return clean_text("".join(f"\\x{ord(c) - 0xDC00:02x}" if "\udc80" <= c <= "\udcff" else c
                              for c in rel))


def _rel(path: str, base: str) -> str:
    return key_text(os.path.relpath(path, base).replace(os.sep, "/"))


def _free_key(key: str, taken: set) -> str:
    """``key`` with ``~N`` before its extension (N = 2, 3, ...), the first one not ``taken``."""
    head, dot, ext = key.rpartition(".")
    if not dot or "/" in ext or not head or head.endswith("/"):
        head, dot, ext = key, "", ""
    n = 2
    while f"{head}~{n}{dot}{ext}" in taken:
        n += 1
    return f"{head}~{n}{dot}{ext}"


def _hidden_or_skipped_dir(name: str, full: str) -> str | None:
    if name.startswith("."):
        return "hidden"
    if name in SKIP_DIRS or os.path.exists(os.path.join(full, "pyvenv.cfg")):
        return "virtualenv/cache directory"
    return None


def _walk_dir(root: str, base: str, w: _Walk, filters) -> None:
    specs: dict[str, Any] = {}

    def unreadable(exc: OSError) -> None:  # a directory os.walk cannot list
        w.skip(_rel(exc.filename or root, base).rstrip("/") + "/",
               f"cannot be read ({exc.strerror or exc})")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        gi = os.path.join(dirpath, ".gitignore")
        if os.path.isfile(gi):
            try:
                with open(gi, encoding="utf-8", errors="replace") as f:
                    specs[dirpath] = _spec(f.read().splitlines())
            except OSError:
                pass

        def gitignored(full: str, is_dir: bool) -> bool:
            d = dirpath
            while True:
                spec = specs.get(d)
                if spec is not None and spec.match_file(_rel(full, d) + ("/" if is_dir else "")):
                    return True
                if d == root or len(d) <= len(root):
                    return False
                d = os.path.dirname(d)

        keep = []
        for name in sorted(dirnames):
            full = os.path.join(dirpath, name)
            link = os.path.islink(full)  # never looked into (its pyvenv.cfg neither)
            why = ("hidden" if name.startswith(".") else None) if link else \
                _hidden_or_skipped_dir(name, full)
            if why is None and gitignored(full, True):
                why = ".gitignore"
            if why:
                w.ignore(why, _rel(full, base) + "/")
            elif link:
                w.skip(_rel(full, base) + "/", _linked_dir(full, w))
            else:
                keep.append(name)
        dirnames[:] = keep
        for name in sorted(filenames):  # every other entry: files, links, FIFOs, sockets, ...
            full = os.path.join(dirpath, name)
            if name.startswith("."):
                w.ignore("hidden", _rel(full, base))
            elif gitignored(full, False):
                w.ignore(".gitignore", _rel(full, base))
            else:
                _add(w, full, base, filters)


def _add(w: _Walk, full: str, base: str, filters, *, named: bool = False) -> None:
    """Add the file ``full`` met by a walk (or ``named`` by the user) as a key, or list why
    not: left out by ``--include``/``--exclude``, or not read (:func:`_not_readable`)."""
    include, exclude = filters
    key = _rel(full, base)
    if include is not None and not include.match_file(key):
        w.ignore("not matching --include", key)
    elif exclude is not None and exclude.match_file(key):
        w.ignore("--exclude", key)
    else:
        why = _not_readable(full, w, named=named)
        if why is None:
            w.files.append((key, full))
        else:
            w.skip(key + ("/" if why == LINKED_DIR else ""), why)


def _glob(pattern: str, prefix: str, w: _Walk, base: str) -> list[str]:
    """The paths matching ``pattern`` (``glob.glob(pattern, recursive=True)``'s rules: ``*``,
    ``?`` and ``[...]`` within a name, ``**`` across directories, hidden names only matched
    by a pattern that starts with a dot), sorted, under the fixed ``prefix``. Unlike
    :func:`glob.glob` it never goes through a symlinked directory (a symlink out of the tree,
    or a loop: ``glob`` follows them, and two loops take it 2**40 steps): one met on the way
    is listed (:meth:`_Walk.skip`), and one that matches is left to the caller."""
    rest = Path(pattern).parts[len(Path(prefix).parts):]
    current = [prefix]

    def entries(d: str) -> list:  # (name, path, "dir" | "link" to a directory | "other")
        out = []
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        kind = "dir" if e.is_dir(follow_symlinks=False) else \
                            "link" if e.is_symlink() and e.is_dir() else "other"
                    except OSError:
                        kind = "other"
                    out.append((e.name, e.path, kind))
        except OSError:
            pass
        return sorted(out)

    def kind_of(p: str) -> str:
        return ("link" if os.path.isdir(p) else "other") if os.path.islink(p) else \
            "dir" if os.path.isdir(p) else "other"

    def met_link(p: str) -> None:  # a symlinked directory the pattern would go through
        w.skip(_rel(p, base) + "/", _linked_dir(p, w))

    def below(d: str, dirs_only: bool):  # d and everything under it, as "**" matches
        yield d
        for name, full, kind in entries(d):
            if name.startswith("."):
                continue
            if kind == "dir":
                if name in SKIP_DIRS:
                    w.ignore("virtualenv/cache directory", _rel(full, base) + "/")
                else:
                    yield from below(full, dirs_only)
            elif kind == "link" and dirs_only:
                met_link(full)
            elif not dirs_only:
                yield full

    for i, part in enumerate(rest):
        last = i == len(rest) - 1
        found: list[str] = []
        match = re.compile(fnmatch.translate(part)).match
        for d in current:
            if part == "**":
                found.extend(below(d, not last))
                continue
            if _MAGIC.search(part):
                met = [(full, kind) for name, full, kind in entries(d) if match(name)
                       and (part.startswith(".") or not name.startswith("."))]
            else:
                full = os.path.join(d, part)
                met = [(full, kind_of(full))] if os.path.lexists(full) else []
            for full, kind in met:
                if last or kind == "dir":
                    found.append(full)
                elif kind == "link":
                    met_link(full)
        current = list(dict.fromkeys(found))
    return sorted(current)


def collect(sources: list, include: list | None = None,
            exclude: list | None = None) -> tuple[_Walk, str, str]:
    """Find the files of a many-path context.

    Returns:
        ``(walk, base, origin)``: the files as (key, path) in key order, the directory keys
        are relative to, and a description of where they came from.
    Raises:
        ContextError: a path that does not exist, or a glob that matches nothing.
    """
    args = []
    for s in sources:
        raw = os.path.expanduser(str(s))
        p = os.path.abspath(raw)
        if os.path.isdir(p):
            args.append(("dir", p, p))
        elif os.path.exists(p):
            args.append(("file", p, p))
        elif _MAGIC.search(raw):
            prefix = []
            for part in Path(p).parts:
                if _MAGIC.search(part):
                    break
                prefix.append(part)
            args.append(("glob", p, str(Path(*prefix))))
        else:
            raise not_found(s)
    if not args:
        raise ContextError("no context given")
    base = os.path.commonpath([a[2] for a in args])
    if not os.path.isdir(base):
        base = os.path.dirname(base)
    filters = (_spec(include) if include else None, _spec(exclude) if exclude else None)
    # the named roots, as real paths: a symlink met on the way may lead into any of them
    w = _Walk(roots=list(dict.fromkeys(os.path.realpath(a[2]) for a in args)))
    for kind, p, prefix in args:
        if kind == "dir":
            _walk_dir(p, base, w, filters)
        elif kind == "file":
            _add(w, p, base, filters, named=True)
        else:
            met = len(w.unread)
            matches = _glob(p, prefix, w, base)
            if not matches and len(w.unread) == met:
                raise ContextError(f"context pattern {p} matched no files")
            for m in matches:
                parts = Path(_rel(m, base)).parts
                if any(x in SKIP_DIRS or x.startswith(".") for x in parts):
                    w.ignore("hidden" if any(x.startswith(".") for x in parts)
                             else "virtualenv/cache directory", _rel(m, base))
                elif os.path.islink(m) and os.path.isdir(m):
                    w.skip(_rel(m, base) + "/", _linked_dir(m, w))
                elif os.path.isdir(m):
                    _walk_dir(m, base, w, filters)
                else:
                    _add(w, m, base, filters)
    w.files = _unique(w)
    w.unread = sorted(set(w.unread))  # (a glob may meet a symlinked directory twice)
    if len(args) == 1 and args[0][0] == "dir":
        origin = f"the directory {base}"
    elif len(args) == 1 and args[0][0] == "glob":
        origin = f"the files matching {args[0][1]}"
    else:
        origin = f"{len(args)} paths under {base}"
    return w, base, origin


def _unique(w: _Walk) -> list:
    """The walk's files as ``(key, Path)`` in key order, each file once and each key once.

    The same entry met twice (a glob's ``**`` and a walk of its match) is kept once; two paths
    to one real file (a symlink inside the roots) are one key, the other listed as ignored;
    two files whose keys agree (a name spelling ``\\xe9`` literally beside one with that
    byte) both stay: the later one, in the order of their names' bytes, gets ``~2`` before its
    extension (:func:`_free_key`), kept in ``w.renamed`` for the listing to name."""
    seen: dict[str, str] = {}
    files, prev = [], None
    taken = {key for key, _ in w.files}
    used: set = set()
    for key, full in sorted(w.files, key=lambda kf: (kf[0], os.fsencode(kf[1]))):
        if (key, os.path.normpath(full)) == prev:
            continue
        prev = (key, os.path.normpath(full))
        real = os.path.realpath(full)
        if real in seen:  # (an inside symlink to a file that is a key already, or the other way round)
            w.ignore("the same file as another key", f"{key} (= {seen[real]})")
            continue
        if key in used:
            new = _free_key(key, taken)
            taken.add(new)
            w.renamed[new] = key
            key = new
        used.add(key)
        seen[real] = key
        files.append((key, Path(full)))
    return sorted(files)


def confining_user():
    """The user whose rights bound what a context reads, or None (the host's own rights).

    On a root host started through sudo (``SUDO_UID``) whose kernels run as another user
    (:func:`kernels.sandbox.kernel_identity`), what the host reads with root's rights and
    hands to such a kernel (converted into a scratch file, or copied for it) must be what
    the user who ran sudo could read: that user (:func:`kernels.sandbox.starting_user`)."""
    from kernels import sandbox
    user = sandbox.starting_user()
    if user is None:
        return None
    try:
        return user if sandbox.kernel_identity() is not None else None
    except sandbox.KernelUserError:  # (the kernel will not start: said there)
        return user


def not_the_users(user) -> str:
    """Why a file ``user`` (:func:`confining_user`) may not read is not read."""
    return (f"not readable by {user.name} (uid {user.uid}), who started rlm through sudo: "
            "not read with root's rights")


def not_found(path: str, where: str = "") -> ContextError:
    """The error for a context path that does not lead to a file: missing, a symlink whose
    target is missing, or a symlink loop (each says which); ``where``: text to add, such as
    ``" (key 'a')"``."""
    shown = shown_path(path)
    if os.path.islink(path):
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return ContextError(f"context path is a symlink loop: {shown}{where}")
        return ContextError(f"context path is a symlink to a missing file: {shown} -> "
                            f"{shown_path(os.readlink(path))}{where}")
    return ContextError(f"context file not found: {shown}{where}")


def shown_path(path: object) -> str:
    """``path`` as a message shows it: as given, or quoted (``repr``) when it is empty, has
    spaces at either end or characters that do not print (so ``' '`` is not shown blank)."""
    text = str(path)
    return text if text and text == text.strip() and text.isprintable() else repr(text)
