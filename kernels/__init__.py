"""Jupyter kernels for RLMs: knows nothing of models; imports nothing from :mod:`rlm`.

Modules:
    kernel: kernel lifecycle on jupyter_client (start, execute, interrupt, shutdown, pool).
    runtime: imported inside every kernel: ``context``, ``llm_query``, ``rlm``, ``FINAL``...
    bridge: the host end of the kernel-to-host channel (authenticated Unix socket).
    protocol: what crosses the hop: framing, op names, error kinds, boot/bind/FINAL code.
    secrets: the one policy of which environment variables are secrets.
    sandbox: who a kernel runs as (unprivileged when the host is root) and its supervisor.
    supervisor: the process every kernel runs under: no process a cell starts outlives it.
"""
