import signal
import sys


def _stop(signum, frame):
    raise KeyboardInterrupt


# a stop signal while the CLI is still being imported ends it as Ctrl-C does (exit 130; nothing
# is running yet), even one inherited as ignored; the CLI puts its own handler in place next
for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, _stop)

try:
    from rlm.cli.main import entry
except KeyboardInterrupt:  # Ctrl-C while the CLI itself is still being imported
    print("rlm: interrupted", file=sys.stderr)
    sys.exit(130)

try:
    entry()
except KeyboardInterrupt:  # a stop before the CLI's own handling (its lazy imports) is in place
    print("rlm: interrupted", file=sys.stderr)
    sys.exit(130)
