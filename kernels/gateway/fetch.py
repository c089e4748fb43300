"""Inside a gateway kernel: a context pulled from the host in chunks, checked by hash.

The host cannot write into a kernel on another machine, and the context must never travel in a
cell's source. So the bind cell names the context by reference (:func:`ref`: its sha256 and
size) and the kernel pulls it over the bridge (:mod:`kernels.gateway.courier`), one
:data:`CHUNK` at a time (base64 in the frame, op :data:`CONTEXT_OP`), writes it to a file while
hashing it, and refuses it if the sha256 differs. Several chunks are in flight at once
(:data:`IN_FLIGHT`), so a large context is not bound by one round trip per chunk.

Where it is kept (see docs/remote-kernels.md): a sandboxed kernel can write only its own
directories, so the file it pulls lives there, named by hash (its private ``/tmp``, or the
launcher's inbox, ``$RLM_CONTEXT_INBOX``, in its working directory), and a second bind of the
same context in that kernel (a session's restarted or added contexts) reads it from there. A
cache shared by the kernels of one gateway host is the kernelspec launcher's
(:mod:`kernels.gateway.kernelspec`): it mounts its cache read-only at ``$RLM_CONTEXT_CACHE``
(checked first, the hash verified before use) and takes the files kernels pulled into their
inbox into it, re-checking their hash, when they exit.
"""
from __future__ import annotations

import base64
import hashlib
import os
import tempfile
import json
import threading
from concurrent.futures import ThreadPoolExecutor

#: Bytes per chunk (4 MiB; about 5.6 MB of base64 on the wire).
CHUNK = 4 << 20
#: Chunks requested at once.
IN_FLIGHT = 4
#: The op a kernel sends to pull one chunk: args ``sha256``, ``offset``, ``length``; value
#: ``{"data": base64 str}``. Served by the host itself, never by the run's handler.
CONTEXT_OP = "context_chunk"
#: Small pieces of a many-file context pulled at once (at most :data:`SMALL_PIECE` bytes each).
PIECES_IN_FLIGHT = 16
#: The largest piece pulled beside others (1 MiB); a larger one is pulled alone.
SMALL_PIECE = 1 << 20
PREFIX = "rlm-remote:"


def ref(sha256: str, size: int) -> str:
    """The reference the bind cell carries instead of a path: ``rlm-remote:SHA256:SIZE``."""
    return f"{PREFIX}{sha256}:{int(size)}"


def parse_ref(value: str) -> tuple[str, int] | None:
    """``(sha256, size)`` of a reference made by :func:`ref`, or None for a plain path."""
    if not value.startswith(PREFIX):
        return None
    sha, _, size = value[len(PREFIX):].partition(":")
    return sha, int(size)


def _verified(path: str, sha: str) -> bool:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return False
    return h.hexdigest() == sha


def resolve(value: str, token: str) -> str:
    """A local path holding the context ``value`` names: ``value`` itself when it is a path,
    else the cached or freshly pulled file (see the module's text).

    Raises:
        ValueError: the pulled bytes do not have the announced sha256 (nothing is kept).
        kernels.gateway.courier.CourierError: the host could not be reached.
    """
    got = parse_ref(value)
    if got is None:
        return value
    sha, size = got
    shared = os.environ.get("RLM_CONTEXT_CACHE")
    if shared and _verified(os.path.join(shared, sha), sha):
        return os.path.join(shared, sha)
    # the launcher's inbox when there is one (it takes the file into the host's cache when the
    # kernel exits), else the kernel's private temporary directory
    here = os.environ.get("RLM_CONTEXT_INBOX") or os.path.join(tempfile.gettempdir(), "rlm-ctx")
    os.makedirs(here, exist_ok=True)
    dest = os.path.join(here, sha)
    if os.path.exists(dest):  # pulled, checked and renamed by this kernel before
        return dest
    _pull(sha, size, token, dest + ".part")
    if not _verified(dest + ".part", sha):
        os.unlink(dest + ".part")
        raise ValueError("the context pulled from the host does not match its sha256: refused")
    os.replace(dest + ".part", dest)
    return dest


def _pull(sha: str, size: int, token: str, part: str) -> None:
    """Write the ``size`` bytes of context ``sha`` to ``part``, :data:`IN_FLIGHT` chunks at a
    time. Raises CourierError or ValueError (a failed chunk)."""
    from kernels.gateway.courier import courier
    offsets = list(range(0, size, CHUNK))
    lock = threading.Lock()
    errors: list[BaseException] = []
    with open(part, "wb") as f:
        f.truncate(size)

    def worker() -> None:
        with open(part, "r+b") as out:
            while True:
                with lock:
                    if not offsets or errors:
                        return
                    off = offsets.pop(0)
                try:
                    reply = courier().call({"token": token, "op": CONTEXT_OP, "args": {
                        "sha256": sha, "offset": off, "length": min(CHUNK, size - off)}})
                    if not reply.get("ok"):
                        raise ValueError(f"the host refused a context chunk: {reply.get('error')}")
                    out.seek(off)
                    out.write(base64.b64decode(reply["value"]["data"]))
                except BaseException as exc:  # noqa: BLE001 - reported once, below
                    with lock:
                        errors.append(exc)
                    return
    threads = [threading.Thread(target=worker, daemon=True)
               for _ in range(min(IN_FLIGHT, len(offsets)) or 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def resolve_context(value: str, fmt: str, token: str) -> str:
    """A local path for the context ``value`` of format ``fmt``: :func:`resolve` for one file;
    for a remote ``"bundle"``, a manifest in the kernel's private temporary directory naming
    the local copy of every piece its remote manifest lists (see the module's text).

    Raises:
        ValueError: a pulled piece or the manifest does not have its sha256, or a remote
            manifest names a path instead of a reference (nothing of it is read).
        kernels.gateway.courier.CourierError: the host could not be reached.
    """
    path = resolve(value, token)
    if fmt != "bundle" or parse_ref(value) is None:
        return path
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    refs = []
    for entry in doc["entries"]:
        if not isinstance(entry[1], str) or parse_ref(entry[1]) is None:
            raise ValueError("a gateway kernel's context manifest must name its pieces by "
                             f"reference, not {entry[1]!r}: refused")
        refs.append(entry[1])
    # small pieces pulled side by side (their requests travel together, see the courier): a
    # directory of many small files is not one round trip each; a large one alone, already
    # IN_FLIGHT chunks at a time (what is in flight stays bounded)
    unique = list(dict.fromkeys(refs))
    small = [r for r in unique if parse_ref(r)[1] <= SMALL_PIECE]
    with ThreadPoolExecutor(max_workers=PIECES_IN_FLIGHT) as pool:
        local = dict(zip(small, pool.map(lambda r: resolve(r, token), small)))
    for r in unique:
        if r not in local:
            local[r] = resolve(r, token)
    for entry in doc["entries"]:
        entry[1] = local[entry[1]]
    here = os.path.join(tempfile.gettempdir(), "rlm-ctx")
    os.makedirs(here, exist_ok=True)
    dest = os.path.join(here, parse_ref(value)[0] + ".local.json")
    with open(dest + ".part", "w", encoding="ascii") as f:
        json.dump(doc, f)
    os.replace(dest + ".part", dest)
    return dest
