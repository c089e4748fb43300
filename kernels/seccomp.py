"""The system calls a sandboxed kernel is refused: a seccomp filter handed to bubblewrap.

A kernel needs none of these, and each opens something the sandbox otherwise closes:

* the kernel keyrings (``add_key``, ``request_key``, ``keyctl``): a value one kernel put in a
  keyring its user shares would be read by the next kernel of that user;
* ``io_uring`` (``io_uring_setup``, ``io_uring_enter``, ``io_uring_register``): a second path
  into the Linux kernel for every I/O call, and a frequent source of its bugs;
* new user namespaces (``unshare`` or ``clone`` with ``CLONE_NEWUSER``): inside one, a cell
  would hold every capability over its own mounts and namespaces. ``clone3``, whose flags a
  filter cannot read, is answered ``ENOSYS``, on which the C library falls back to ``clone``.

Each is refused with ``EPERM`` (a cell sees ``PermissionError``); every other call is allowed.
A call made under another ABI than the machine's own (32-bit calls on x86_64, x32) is refused:
its numbers differ. The program is classic BPF (``seccomp(2)``, ``SECCOMP_SET_MODE_FILTER``),
assembled here with :mod:`struct` for x86_64 and aarch64; :func:`program` returns None for
any other machine, and bubblewrap then runs without a filter. bubblewrap reads it from the
descriptor named by ``--seccomp`` (``bwrap(1)``) and loads it just before it starts the kernel.
"""
from __future__ import annotations

import os
import platform
import struct

__all__ = ["program", "program_fd", "REFUSED"]

# classic BPF (linux/filter.h, linux/bpf_common.h) and seccomp (linux/seccomp.h)
_LD_W_ABS = 0x20
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45
_RET_K = 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_EPERM, _ENOSYS = 1, 38
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data
_CLONE_NEWUSER = 0x10000000
_X32_BIT = 0x40000000

#: Per machine: its audit architecture, and the numbers of the calls named below.
_MACHINES = {
    "x86_64": (0xC000003E, {"add_key": 248, "request_key": 249, "keyctl": 250,
                            "io_uring_setup": 425, "io_uring_enter": 426,
                            "io_uring_register": 427, "clone": 56, "unshare": 272,
                            "clone3": 435}),
    "aarch64": (0xC00000B7, {"add_key": 217, "request_key": 218, "keyctl": 219,
                             "io_uring_setup": 425, "io_uring_enter": 426,
                             "io_uring_register": 427, "clone": 220, "unshare": 97,
                             "clone3": 435}),
}
_MACHINES["amd64"] = _MACHINES["x86_64"]
_MACHINES["arm64"] = _MACHINES["aarch64"]

#: The calls refused outright (``EPERM``).
REFUSED = ("add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter",
           "io_uring_register")


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes | None:
    """The filter for ``machine`` (default: this one's, ``platform.machine()``), as the bytes
    of its ``struct sock_filter`` array; None for a machine it does not know."""
    known = _MACHINES.get((machine or platform.machine()).lower())
    if known is None:
        return None
    arch, nr = known
    deny = _ERRNO | _EPERM
    ops = [_op(_LD_W_ABS, _ARCH), _op(_JEQ_K, arch, 1, 0), _op(_RET_K, deny),
           _op(_LD_W_ABS, _NR)]
    if arch == _MACHINES["x86_64"][0]:  # x32 calls share the architecture, with this bit set
        ops += [_op(_JGE_K, _X32_BIT, 0, 1), _op(_RET_K, deny)]
    for name in REFUSED:
        ops += [_op(_JEQ_K, nr[name], 0, 1), _op(_RET_K, deny)]
    ops += [_op(_JEQ_K, nr["clone3"], 0, 1), _op(_RET_K, _ERRNO | _ENOSYS),
            # clone or unshare asking for a new user namespace (flags: the first argument)
            _op(_JEQ_K, nr["clone"], 1, 0), _op(_JEQ_K, nr["unshare"], 0, 3),
            _op(_LD_W_ABS, _ARG0), _op(_JSET_K, _CLONE_NEWUSER, 0, 1), _op(_RET_K, deny),
            _op(_RET_K, _ALLOW)]
    return b"".join(ops)


def program_fd() -> int | None:
    """A descriptor (close-on-exec; the launch passes it on) from which bubblewrap reads
    :func:`program`, at offset 0; None where there is no filter for this machine.
    Raises OSError (no anonymous file could be made)."""
    prog = program()
    if prog is None:
        return None
    fd = os.memfd_create("rlm-seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, prog)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
