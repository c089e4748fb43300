"""The ``rlm`` command and its subcommands."""
