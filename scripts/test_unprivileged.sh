#!/usr/bin/env bash
# The sandbox and escape tests as an unprivileged user (called by scripts/test.sh as root): a
# user `rlm-ci`, a copy of the checkout it owns, its own venv from the system's python3 with the
# core dependencies and pytest, then the tests of tests/kernel/test_escape.py and friends.
set -euo pipefail
cd "$(dirname "$0")/.."
PY3=$(command -v /usr/bin/python3 || command -v python3)
id rlm-ci >/dev/null 2>&1 || useradd --create-home --shell /bin/sh rlm-ci
HOME_DIR=$(getent passwd rlm-ci | cut -d: -f6)
COPY="$HOME_DIR/checkout"
rm -rf "$COPY" && mkdir -p "$COPY"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$COPY"
chown -R rlm-ci: "$COPY"
echo "unprivileged tests: as $(id -un rlm-ci) (uid $(id -u rlm-ci)), $($PY3 --version)"
runuser -u rlm-ci -- env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$HOME_DIR" sh -c "
    set -e
    cd '$COPY'
    '$PY3' -m venv .venv
    .venv/bin/python -m pip install -q -e . pytest pytest-timeout 2>pip.err || { cat pip.err >&2; exit 1; }
    .venv/bin/python -m pytest -q -p no:cacheprovider tests/kernel/test_escape.py \
        tests/kernel/test_sandbox_modes.py tests/kernel/test_limits.py tests/kernel/test_tenants.py \
        tests/kernel/test_cgroups.py tests/kernel/test_bridge_limits.py tests/kernel/test_cell_data.py \
        tests/context/test_confined.py -rs"
