"""Jupyter kernels for RLMs: knows nothing of models; imports nothing from :mod:`rlm`.

Modules:
    kernel: kernel lifecycle on jupyter_client (start, execute, interrupt, shutdown, pool).
    runtime: imported inside every kernel: ``context``, ``llm_query``, ``rlm``, ``FINAL``...
    bridge: the host end of the kernel-to-host channel (authenticated Unix socket).
    protocol: what crosses the hop: framing, op names, error kinds, boot/bind/FINAL code.
    secrets: the one policy of which environment variables are secrets.
    sandbox: who a kernel runs as (unprivileged when the host is root) and its supervisor.
    supervisor: the process every kernel runs under: no process a cell starts outlives it.
    identity: a user of its own for every kernel on a root host (a managed uid range).
    cgroups, limits: a control group per sandboxed kernel (memory, processes, CPU share over
        all its processes), and what stands in without one.
    seccomp: the system calls a sandboxed kernel is refused (keyrings, io_uring, user ns).
"""
