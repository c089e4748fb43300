"""Ending a kernel's processes: wait for ready, stop politely, kill, wait for exit, reap.

What :class:`kernels.kernel.Kernel` does to the processes it launched (the kernel under its
supervisor, see :mod:`kernels.sandbox`), kept apart from the kernel's protocol work.
"""
from __future__ import annotations

import os
import queue
import select
import shutil
import signal
import stat
import tempfile
import time

from kernels import identity, sandbox
from kernels.launch import Launched


def wait_for_ready(km: Launched, kc, timeout: float) -> None:
    """Wait until the kernel answers ``kernel_info`` on its shell channel and its IOPub channel
    delivers (a kernel's first IOPub messages are lost until the subscription is made); the
    public client calls of jupyter_client's ``wait_for_ready``, without its last step: it then
    waits for 0.2 s of IOPub silence, which delayed every kernel start by at least 0.2 s. A
    leftover IOPub message is harmless here: :meth:`Kernel.execute` reads only its own cell's.

    Raises:
        RuntimeError: the kernel died, or did not answer within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        kc.kernel_info()
        try:
            reply = kc.get_shell_msg(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            reply = None
        if reply is not None and reply.get("msg_type") == "kernel_info_reply":
            try:
                kc.get_iopub_msg(timeout=0.2)  # its status messages: IOPub is connected
                return
            except queue.Empty:
                pass  # not subscribed yet: ask again
        if not km.is_alive():
            raise RuntimeError("Kernel died before replying to kernel_info")
        if time.monotonic() > deadline:
            raise RuntimeError(f"Kernel didn't respond in {timeout:g} seconds")


def stop_kernel(km: Launched, tag: str) -> None:
    """Shut a kernel down at once, with every process it started. Never raises.

    The supervisor is asked first (SIGTERM: it kills the kernel and all its descendants,
    which may have left its process group); it is waited for without being reaped, so
    its process group id cannot be reused before the group is killed and the process reaped.
    If the supervisor was already gone (killed before it could clean up), every process
    still carrying the kernel's ``tag`` is killed (:func:`kernels.sandbox.kill_tagged`).

    Then (the supervisor exited, or there is none, or it did not exit in time): SIGKILL to the
    kernel's process group, reap (:func:`reap`), and ``cleanup_resources()`` (connection and
    IPC files).
    """
    kill_kernel(km, tag)
    proc = process_of(km)
    if proc is not None:
        reap(proc)
    km.release()
    km.cleanup_resources()


def kill_kernel(km: Launched, tag: str, *, direct: bool = False) -> None:
    """The process part of :func:`stop_kernel`: end the kernel's processes, leave its client (its
    sockets, its ZeroMQ context) alone. Never raises. ``direct``: without a supervisor, kill
    the kernel process itself (else :func:`stop_kernel` leaves that to :func:`reap`)."""
    proc = process_of(km)
    if proc is None:
        return
    if not sandbox.supervisor_available():
        if direct:
            try:
                proc.kill()
            except OSError:
                pass
    elif proc.poll() is not None:
        if proc.returncode < 0 and tag:  # the supervisor was killed: it could not clean up
            sandbox.kill_tagged(tag)
    else:
        try:
            os.kill(km.stop_pid(), signal.SIGTERM)
            wait_exit(proc.pid, 10.0)
        except (OSError, ChildProcessError):
            pass


def wait_exit(pid: int, limit: float) -> bool:
    """Wait up to ``limit`` seconds for child ``pid`` to exit, without reaping it: on a pidfd
    (Linux 5.3+: woken at the exit) else by polling every 5 ms. Returns whether it exited.
    Raises OSError, ChildProcessError (not our child)."""
    deadline = time.monotonic() + limit
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    try:
        while not exited(pid):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if fd >= 0:
                select.select([fd], [], [], left)
            else:
                time.sleep(0.005)
        return True
    finally:
        if fd >= 0:
            os.close(fd)


def exited(pid: int) -> bool:
    """Whether child ``pid`` has exited (it is not reaped here). Raises ChildProcessError (not
    our child)."""
    return bool(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT))


def process_of(km: "Launched | None"):
    """The kernel's top process (its supervisor on Linux), a ``subprocess.Popen``; None before
    the launch."""
    return km.process if km is not None else None


def reap(proc) -> None:
    """After supervisor ``proc`` exited: SIGKILL what is left of its process group while its id
    is still ours (not reaped yet; as jupyter_client's kill does), reap it, close its pipes.
    Never raises."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except Exception:
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


def end_kernel(km: "Launched | None", kc, tag: str, workdir: str) -> None:
    """The end of :meth:`Kernel.shutdown`, on the thread that used the client: close its
    channels, :func:`stop_kernel` the kernel, remove ``workdir`` (our own temporary directory; ""
    for none). Never raises."""
    if kc is not None:
        try:
            kc.stop_channels()
        except Exception:
            pass
    if km is not None:
        stop_kernel(km, tag)
    if workdir:
        remove_tree(workdir)


def remove_tree(path: str) -> None:
    """Remove the directory ``path`` and everything in it, whatever modes a cell set there (a
    mode-000 directory, a read-only file in a read-only directory): where a plain removal
    fails, every directory below is opened to its owner (``u+rwx``, top down: a closed one
    cannot be listed before) and the removal tried again. Never raises.

    Called once the kernel's processes are gone, so nothing changes the tree meanwhile;
    symbolic links are never followed (each entry is ``lstat``-ed before its ``chmod``)."""
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    stack = [path]
    while stack:
        d = stack.pop()
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                continue
            if st.st_mode & 0o700 != 0o700:
                os.chmod(d, stat.S_IMODE(st.st_mode) | 0o700)
            stack += [os.path.join(d, name) for name in os.listdir(d)]
        except OSError:
            continue
    shutil.rmtree(path, ignore_errors=True)


_swept: list[int] = []  # the pid of the process that swept already (once per process)


def sweep_stale_kernel_dirs() -> int:
    """Once per process: remove the kernel directories (``rlm-k-PID-*`` in the temporary
    directory) of this user's hosts that are gone (process ``PID`` no longer exists): what a
    host killed in the middle of a shutdown left behind. Returns how many; never raises."""
    if _swept == [os.getpid()]:
        return 0
    _swept[:] = [os.getpid()]
    from kernels import cgroups  # the control groups of those hosts' kernels too
    cgroups.sweep_stale()
    return remove_dirs_of_gone_hosts("rlm-k-", {os.getuid(), _kernel_uid()})


def remove_dirs_of_gone_hosts(prefix: str, owners: set[int]) -> int:
    """Remove the directories ``PREFIX<PID>-*`` in the temporary directory owned by one of
    ``owners`` (uids; or by a kernel user of the harness's range, :mod:`kernels.identity`)
    whose host process ``PID`` no longer exists; returns how many. Another
    user's, or one whose host is alive, is left alone. Never raises."""
    import glob
    removed = 0
    for d in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}*-*")):
        try:
            pid = int(os.path.basename(d)[len(prefix):].split("-")[0])
            uid = os.stat(d).st_uid
            if pid == os.getpid() or not (uid in owners or identity.managed(uid)):
                continue
            os.kill(pid, 0)  # raises ProcessLookupError when the host is gone
        except ProcessLookupError:
            remove_tree(d)
            removed += 1
        except (ValueError, IndexError, OSError):
            continue  # not ours, or its host is alive (PermissionError: another user's)
    return removed


def _kernel_uid() -> int:
    """The uid kernels run as here (a root host's kernel directories are chowned to it)."""
    try:
        ident = sandbox.kernel_identity()
    except sandbox.KernelUserError:
        return os.getuid()
    return ident.uid if ident is not None else os.getuid()
