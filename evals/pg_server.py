"""A throwaway PostgreSQL server for tests and benchmarks: ``initdb`` and ``pg_ctl`` from the
Debian ``postgresql`` package, in a temporary directory, on 127.0.0.1 and a free port.

    with temporary_server() as url:      # postgresql://postgres@127.0.0.1:PORT/rlm
        journal = Journal(fresh_schema(url))

``initdb`` refuses to run as root, so as root the server runs as the ``postgres`` user
(``runuser``). Durability is switched off (``fsync=off``): this is for measuring and testing the
journal's own work, not the disk. ``$RLM_PG_BIN`` overrides the binaries' directory.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["pg_bin", "temporary_server", "fresh_schema"]

_SCHEMAS = itertools.count(1)


def pg_bin() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl`` (newest installed version)."""
    env = os.environ.get("RLM_PG_BIN")
    if env:
        return Path(env)
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else Path("/usr/lib/postgresql/15/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def temporary_server(durable: bool = False) -> Iterator[str]:
    """Start a server, create its database ``rlm``, yield its URL; stop and delete it after.

    Raises:
        FileNotFoundError: no PostgreSQL server binaries (install the ``postgresql`` package).
    """
    import psycopg
    binaries = pg_bin()
    if not (binaries / "initdb").exists():
        raise FileNotFoundError(f"PostgreSQL server binaries not found in {binaries}: install "
                                f"the Debian `postgresql` package or set RLM_PG_BIN")
    root = Path(tempfile.mkdtemp(prefix="rlm-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", _free_port()
    try:
        subprocess.run(as_user + [str(binaries / "initdb"), "-D", str(data), "-A", "trust",
                                  "-U", "postgres", "--no-sync", "-E", "UTF8"],
                       check=True, capture_output=True, timeout=120)
        opts = (f"-c listen_addresses=127.0.0.1 -c port={port} "
                f"-c unix_socket_directories={root} -c max_connections=200"
                + ("" if durable else " -c fsync=off -c full_page_writes=off"))
        subprocess.run(as_user + [str(binaries / "pg_ctl"), "-D", str(data), "-o", opts, "-l",
                                  str(root / "log"), "-w", "-t", "60", "start"],
                       check=True, capture_output=True, timeout=90)
        try:
            with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres",
                                 autocommit=True) as c:
                c.execute("CREATE DATABASE rlm")
            yield f"postgresql://postgres@127.0.0.1:{port}/rlm"
        finally:
            subprocess.run(as_user + [str(binaries / "pg_ctl"), "-D", str(data), "-m",
                                      "immediate", "stop"], capture_output=True, timeout=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fresh_schema(url: str, prefix: str = "j") -> str:
    """Create an empty schema in ``url``'s database (named ``prefix``, made an identifier, plus
    a counter); return a journal URL that uses it."""
    import psycopg
    name = f"{re.sub(r'[^a-z0-9_]', '_', prefix.lower())[:40]}_{os.getpid()}_{next(_SCHEMAS)}"
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {name}")
    return f"{url}?options=-csearch_path%3D{name}"
