#!/usr/bin/env bash
# Install headless Chromium (the Debian package `chromium`) for the viewer's browser tests and
# `python -m evals.bench_view`, only when it is missing and apt is available. Idempotent; never
# fails the caller: without a browser those tests skip and say why.
set -uo pipefail
if [ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "note: no apt-get here; install Chromium yourself (or set RLM_CHROMIUM) for the browser tests" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "note: not root and no passwordless sudo; cannot install chromium (browser tests will skip)" >&2
    exit 0
  fi
fi
echo "installing chromium (Debian package) for the viewer's browser tests..." >&2
if ! { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null &&
       $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; then
  echo "note: apt-get install chromium failed; the browser tests will skip" >&2
fi
exit 0
