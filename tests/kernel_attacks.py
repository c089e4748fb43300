"""Attacks on a kernel's limits and on what its runs share, as cell code a hostile model would
write (tests only; the bridge's own are in :mod:`bridge_attacks`).

Each constant is the source of one cell that prints one line ``<TAG> <json>`` saying what it
saw. Each calls ``hold(tag)`` at the moment its attack is at its height (the memory, the disk,
the processes it took still held, the keyring value set): :func:`cell` defines ``hold`` as the
test wants it, doing nothing, sleeping, or making a sub-call that the scripted endpoint holds
while other clients are served (``rlm serve``'s tenants test). :func:`printed` reads a tag's
line back from what the model was sent.
"""
from __future__ import annotations

import json


def cell(code: str, hold: str = "pass") -> str:
    """``code`` with ``hold(tag)`` defined first, its body the statement ``hold``: ``"pass"``,
    ``"import time; time.sleep(10)"``, or ``"llm_query('during ' + tag)"``."""
    return f"def hold(tag):\n    {hold}\n" + code


def printed(texts: list[str], tag: str):
    """The JSON after ``<tag> `` on a line of any of ``texts`` (the user messages a model was
    sent: what each cell printed). Raises AssertionError when no such line is there."""
    for text in texts:
        for line in text.splitlines():
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
    raise AssertionError(f"no {tag} line in what the model saw: {texts[-1][:2000]}")


#: Three processes of 400 MiB each, held at once (each alone is within a cap of 768 MiB or
#: 1,024 MiB, all three are not): each says "held" once it has its memory and keeps it until
#: its stdin closes, after the hold.
HOGS = r'''
import json, subprocess, sys
hog = "import sys; b = bytearray(400 << 20); print('held', flush=True); sys.stdin.read()"
ps = [subprocess.Popen([sys.executable, "-c", hog], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE) for _ in range(3)]
said = [p.stdout.readline().decode().strip() for p in ps]  # "" for one killed before
hold("HOGS")
for p in ps:
    p.stdin.close()
print("HOGS " + json.dumps({"codes": [p.wait() for p in ps], "said": said}))
'''

#: One process asking for 1,000 MiB at once (over a 768 MiB cap): ``MemoryError`` per process,
#: what stands in where a kernel's processes cannot be counted together.
ONE_HOG = r'''
import json
try:
    b = bytearray(1000 << 20)
    got = "allocated"
except MemoryError:
    got = "MemoryError"
hold("ONE")
print("ONE " + json.dumps(got))
'''

#: Forks until refused; every child lives until the cell closes the pipe, after the hold.
BOMB = r'''
import json, os
r, w = os.pipe()
kids, err = [], None
try:
    for _ in range(400):
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.read(r, 1)  # returns once the cell's end is closed
            os._exit(0)
        kids.append(pid)
except OSError as e:
    err = e.strerror
hold("BOMB")
os.close(w)
for pid in kids:
    os.waitpid(pid, 0)
print("BOMB " + json.dumps([len(kids), err]))
'''

#: The keyring calls: ``add(ring)`` puts a value in a keyring, ``search(ring)`` looks for it
#: (-3 the session keyring, -4 the user keyring); each returns what happened, as text.
KEYRING = r'''
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
def add(ring):
    r = libc.syscall(NR[0], b"user", b"rlm-left-behind", b"secret-value", 12, ring)
    return "added" if r >= 0 else os.strerror(ctypes.get_errno())
def search(ring):
    r = libc.syscall(NR[1], 10, ring, b"user", b"rlm-left-behind", 0)  # KEYCTL_SEARCH
    return "found" if r >= 0 else os.strerror(ctypes.get_errno())
'''

#: A value put in the session and user keyrings, held, then looked for.
KEYS = KEYRING + r'''
added = [add(-3), add(-4)]
hold("KEYS")
print("KEYS " + json.dumps({"add": added, "search": [search(-3), search(-4)]}))
'''

#: A 200 MiB file in every place a cell may write, the host's working directory (where the
#: kernel's connection file is) included, all held at once; then, each removed, many files.
DISK = r'''
import json, os
args = open("/proc/self/cmdline", "rb").read().split(b"\0")
workdir = os.path.dirname(args[args.index(b"-f") + 1].decode())
places = {"/tmp": "/tmp", "/tmp/home": "/tmp/home", "/dev/shm": "/dev/shm", "workdir": workdir}
def big(d):
    try:
        with open(os.path.join(d, "big"), "wb") as f:
            for _ in range(200):
                f.write(b"x" * (1 << 20))
        return "wrote 200 MiB"
    except OSError as e:
        return e.strerror
def many(d):
    n = 0
    try:
        os.makedirs(os.path.join(d, "many"), exist_ok=True)
        for n in range(20000):
            with open(os.path.join(d, "many", str(n)), "wb") as f:
                f.write(b"y" * 4096)
        return "wrote 20000 files"
    except OSError as e:
        return f"{e.strerror} after {n}"
out = {name: [big(d)] for name, d in places.items()}
hold("DISK")  # every place is as full as it gets
for name, d in places.items():
    try:
        os.remove(os.path.join(d, "big"))
    except OSError:
        pass
    out[name].append(many(d))
    os.system(f"rm -rf {os.path.join(d, 'many')}")
print("DISK " + json.dumps(out))
'''

#: What a cell leaves in the places it may write: a mode-000 directory holding a file, and a
#: read-only file in a read-only directory (in its working directory and in its home).
LEAVE = r'''
import json, os
args = open("/proc/self/cmdline", "rb").read().split(b"\0")
workdir = os.path.dirname(args[args.index(b"-f") + 1].decode())
made = []
for base in (workdir, os.path.expanduser("~"), os.getcwd()):
    try:
        os.makedirs(os.path.join(base, "closed", "deeper"), exist_ok=True)
        open(os.path.join(base, "closed", "deeper", "f"), "w").write("x")
        os.chmod(os.path.join(base, "closed", "deeper"), 0)
        os.chmod(os.path.join(base, "closed"), 0)
        os.makedirs(os.path.join(base, "ro"), exist_ok=True)
        open(os.path.join(base, "ro", "f"), "w").write("x")
        os.chmod(os.path.join(base, "ro", "f"), 0o444)
        os.chmod(os.path.join(base, "ro"), 0o555)
        made.append(base)
    except OSError as e:
        made.append(e.strerror)
print("LEFT " + json.dumps({"workdir": workdir, "made": made}))
'''
