"""The kernel supervisor: parent of one Jupyter kernel, reaper of everything it starts.

Run by :mod:`kernels.kernel` as ``python -I -S supervisor.py CONF -- KERNEL_ARGV...``
(standard library only, and little of it: it is on the way to every kernel's start; CONF is
a hex-encoded :mod:`marshal` dump from :func:`kernels.sandbox.supervised_argv`).
It forks the kernel and then:

* is a child subreaper, so every process the kernel starts stays its descendant, whatever
  session or process group it moves to;
* ignores SIGINT (Jupyter interrupts the whole process group: that is the kernel's);
* on the kernel's exit, on SIGTERM (the host shutting the kernel down) or any other
  catchable signal, or when its own parent (the host) is gone, kills every descendant: it walks ``/proc`` and
  sends SIGKILL until no live descendant is left, reaps them, and exits with the kernel's
  exit code (128 + signal number if it was killed); when the host died it also removes the
  kernel's temporary working directory (CONF ``own_dir``).

In a sandbox (:mod:`kernels.bwrap`) the supervisor runs inside it, with its own PID namespace:
its parent is bubblewrap's, which dies with the host (``--die-with-parent``), so CONF ``host``
is 0 there and the parent at its start is watched instead.

Between fork and exec, the kernel process: resets its signals, optionally (CONF ``uid``)
chowns its working directory and connection file to that user, covers directories the user
may not enter (CONF ``reveal``) in a private mount namespace, drops to the user (no
supplementary groups), sets its resource limits (CONF ``rlimits``), sets ``no_new_privs`` and a parent-death SIGKILL, and sets
``JPY_PARENT_PID`` to the supervisor (ipykernel exits when its parent changes). A failure
there is written to CONF ``errfile`` and the kernel exits with 127.
"""
import ctypes
import marshal
import os
import signal
import stat
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 0x1000, 0x4000, 1 << 18

#: The supervisor's exit code when its host died (it then also removes CONF ``own_dir``).
HOST_GONE = 129

_libc = ctypes.CDLL(None, use_errno=True)
#: Signals that end the supervisor (after its clean-up): every catchable one but SIGINT
#: (ignored: it is the kernel's interrupt), SIGCHLD (a child exited) and the stop/continue
#: family. Only SIGKILL ends it without clean-up; the host then falls back on the tag.
_STOP = tuple(sorted(set(signal.valid_signals()) - {
    signal.SIGKILL, signal.SIGSTOP, signal.SIGINT, signal.SIGCHLD, signal.SIGCONT,
    signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGWINCH, signal.SIGURG}))


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option, arg):
    _check(_libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), f"prctl({option})")


def _mount(src, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else os.fsencode(s))
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _descendants(root):
    """Live (not zombie) descendants of ``root``, from /proc."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
            rest = data[data.rindex(b")") + 2:].split()
        except (OSError, ValueError):
            continue
        children.setdefault(int(rest[1]), []).append((int(name), rest[0]))
    out, stack = [], [root]
    while stack:
        for pid, state in children.get(stack.pop(), ()):
            if state not in (b"Z", b"X"):
                out.append(pid)
            stack.append(pid)
    return out


def _reap():
    """Reap every exited child; returns {pid: wait status}."""
    done = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = status


def _kill_tree(root, limit=10.0):
    """SIGKILL every descendant of ``root`` until none is alive, then reap them."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        pids = _descendants(root)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap()
        _child_event(0.002)
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            _child_event(0.005)


def _child_event(limit):
    """Wait up to ``limit`` seconds for a child to change state (SIGCHLD is blocked here, so
    one sent since the last wait is pending and returns at once: no exit is missed)."""
    try:
        signal.sigtimedwait({signal.SIGCHLD}, limit)
    except (AttributeError, OSError):
        time.sleep(limit)


def _reveal(plan):
    """Cover each directory of ``plan`` with a tmpfs holding only the listed entries."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for directory, names in plan:
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
        try:
            _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711,size=64k")
            for name in names:
                src, dst = f"/proc/self/fd/{fd}/{name}", os.path.join(directory, name)
                try:
                    st = os.lstat(src)
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(src), dst)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    os.mkdir(dst)
                else:
                    open(dst, "wb").close()
                _mount(src, dst, None, MS_BIND | MS_REC)
        finally:
            os.close(fd)


def _child(conf, argv, supervisor):
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGINT, signal.SIGCHLD) + _STOP:
        signal.signal(sig, signal.SIG_DFL)
    env = dict(os.environ)
    env["JPY_PARENT_PID"] = str(supervisor)
    if conf.get("rlimits"):
        import resource  # before the switch of user, while the standard library is in reach
    uid = conf.get("uid")
    if uid is not None:
        gid = conf["gid"]
        for path in conf.get("chown", ()):
            if os.path.exists(path):
                os.chown(path, uid, gid)
        if conf.get("reveal"):
            try:
                _reveal(conf["reveal"])
            except OSError as exc:
                dirs = ", ".join(d for d, _ in conf["reveal"])
                raise OSError(exc.errno, f"kernels run as user {conf['user']!r} (the host runs as "
                              f"root) but it may not enter {dirs}, and hiding it in a mount "
                              f"namespace failed ({exc.strerror}); make it readable "
                              "(chmod o+x) or set RLM_KERNEL_USER=root") from None
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        env.update(HOME=conf["home"], USER=conf["user"], LOGNAME=conf["user"])
        os.chdir(conf["home"])
    if conf.get("rlimits"):  # after the switch of user: the process count is that user's
        for name, value in conf["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
    if conf.get("lifeline") is not None:  # the host's lifeline is the supervisor's to watch
        os.close(conf["lifeline"])
    if conf.get("errfd") is not None:  # written to only if exec fails: closed by a success
        os.set_inheritable(conf["errfd"], False)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    if os.getppid() != supervisor:
        os._exit(1)
    os.execvpe(argv[0], argv, env)


def _join_groups(fds):
    """Move this process into the kernel's control groups (:mod:`kernels.cgroups`): ``0``
    written to a ``cgroup.procs`` moves the writer; every process forked later is counted."""
    for fd in fds:
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def _report(conf, text):
    """Why the kernel could not start, for the host: to CONF ``errfd`` (a file the host opened:
    in a sandbox the working directory is read-only) or CONF ``errfile``."""
    try:
        if conf.get("errfd") is not None:
            os.write(conf["errfd"], text.encode("utf-8", "replace"))
        else:
            with open(conf["errfile"], "w") as f:
                f.write(text)
    except OSError:
        pass


def _host_gone(lifeline):
    """True once the host's lifeline pipe (CONF ``lifeline``) reads end-of-file."""
    if lifeline is None:
        return False
    import select
    if not select.select([lifeline], [], [], 0)[0]:
        return False
    try:
        return os.read(lifeline, 1) == b""
    except OSError:
        return True


def _watch(kernel, host, lifeline=None):
    """Wait for the kernel's exit, a stop signal or the host's death; returns the exit code to
    use and whether the host stopped the kernel or is gone (not the kernel's own exit)."""
    watched = {signal.SIGCHLD, *_STOP}
    while True:
        info = signal.sigtimedwait(watched, 0.25)
        done = _reap()
        if kernel in done:
            status = done[kernel]
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
            return code, False
        if info is not None and info.si_signo != signal.SIGCHLD:
            return 128 + info.si_signo, True
        if os.getppid() != host or _host_gone(lifeline):
            return HOST_GONE, True


def _remove_tree(path):
    """Remove ``path`` whatever modes a cell set below it (as :func:`kernels.process.remove_tree`:
    this module imports nothing of the project): directories opened to their owner, top down,
    where a plain removal fails; links never followed."""
    import shutil
    try:
        shutil.rmtree(path)
        return
    except OSError:
        pass
    stack = [path]
    while stack:
        d = stack.pop()
        try:
            st = os.lstat(d)
            if stat.S_ISDIR(st.st_mode):
                os.chmod(d, stat.S_IMODE(st.st_mode) | 0o700)
                stack += [os.path.join(d, name) for name in os.listdir(d)]
        except OSError:
            continue
    shutil.rmtree(path, ignore_errors=True)


def main(args):
    conf = marshal.loads(bytes.fromhex(args[0]))
    argv = args[2:] if len(args) > 1 and args[1] == "--" else args[1:]
    # the host that launched this supervisor; a host killed before this line ran left it
    # with another parent already (init or a subreaper), so getppid() alone would never see
    # the host die and the kernel would outlive it
    host = conf.get("host") or os.getppid()
    me = os.getpid()
    try:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, *_STOP})
    try:
        _join_groups(conf.get("cgroup_fds") or ())
    except OSError as exc:
        _report(conf, f"the kernel could not join its control group ({exc.strerror})")
        os._exit(127)
    kernel = os.fork()
    if kernel == 0:
        try:
            _child(conf, argv, me)
        except BaseException as exc:  # report why the kernel could not start
            _report(conf, f"{exc}")
        os._exit(127)
    if conf.get("errfd") is not None:  # the child's to write; no cell may reach it here
        os.close(conf["errfd"])
    code, stopped = _watch(kernel, host, conf.get("lifeline"))
    _kill_tree(me)
    if stopped and conf.get("own_dir"):
        # the kernel's temporary working directory is not needed any more; remove it here too:
        # the host does after this exits, unless it is gone or is stopped itself before that
        # (a second Ctrl-C during its shutdown). A kernel that exited on its own keeps it: it
        # may hold the reason its start failed (errfile), which the host reads.
        _remove_tree(conf["own_dir"])
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
