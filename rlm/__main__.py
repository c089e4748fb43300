import sys

try:
    from rlm.cli.main import entry
except KeyboardInterrupt:  # Ctrl-C while the CLI itself is still being imported
    print("rlm: interrupted", file=sys.stderr)
    sys.exit(130)

entry()
