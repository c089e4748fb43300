"""Attacks on the host's bridge, as cell code a hostile model would write (tests only).

Each constant is the source of one cell: it talks to the bridge as the kernel's own runtime
does (the socket it was bound to), but writes frames by hand, and prints one line
``<TAG> <json>`` saying what it saw. :func:`seen` reads those lines back from a request's
messages (the cell's output reaches the model in the next turn).
"""
from __future__ import annotations

import json

#: A frame announcing 4 GiB (then 512 MiB of it sent), and an ``llm_query`` of 70 MiB (over
#: the 64 MiB frame cap) through the real runtime; then an ordinary call.
BIG = r'''
import json, socket, struct
from kernels.protocol import recv_message
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(60)
s.connect(__rlm_rt._CONF["socket"])
try:
    s.sendall(struct.pack(">I", 2**32 - 1))
    z = b"\0" * (1 << 20)
    for _ in range(512):
        s.sendall(z)
except OSError:
    pass
raw = recv_message(s)
s.close()
try:
    llm_query("x" * (70 * 2**20))
    capped = "sent"
except Exception as exc:
    capped = type(exc).__name__ + ": " + str(exc)
print("BIG " + json.dumps({"raw": raw, "capped": capped, "after": llm_query("after big")}))
'''

#: A 200,000-deep JSON frame and a frame that is not an object, by hand; then an ordinary call.
DEEP = r'''
import json, socket, struct
from kernels.protocol import recv_message
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(60)
s.connect(__rlm_rt._CONF["socket"])
deep = b"[" * 200000 + b"]" * 200000
s.sendall(struct.pack(">I", len(deep)) + deep)
first = recv_message(s)
s.sendall(struct.pack(">I", 2) + b"[]")
second = recv_message(s)
s.close()
print("DEEP " + json.dumps({"deep": first, "list": second, "after": llm_query("after deep")}))
'''

#: 2,000 connections opened at once (or as many as the kernel's descriptors allow), the ones
#: the host refused closed, the rest held: how many the host refused (and with what), whether a
#: new thread's call is refused while they are held, whether the held connection of the
#: cell's own thread still works, and whether a new thread's call works once they are closed.
#: ``llm_query("flooded")`` tells the scripted server the flood is in place; its answer can be
#: held back (by the test) while another run goes on.
FLOOD = r'''
import json, select, socket, threading
from kernels.protocol import recv_message
llm_query("before flood")  # this thread's own connection, opened before the flood
socks, refused, message, ran_out = [], 0, "", ""
try:
    for _ in range(2000):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(__rlm_rt._CONF["socket"])
        socks.append(s)
except OSError as exc:  # the kernel's own descriptor limit, where it is under 2,000
    ran_out = str(exc)
opened = len(socks)
poller = select.poll()
for s in socks:
    poller.register(s, select.POLLIN)
if socks:  # the host takes connections in order: once the last is answered, all are
    last = select.poll(); last.register(socks[-1], select.POLLIN); last.poll(10000)
ready = {fd for fd, _ in poller.poll(0)}
kept = []
for s in socks:
    if s.fileno() in ready:  # refused: read why, and give the descriptor back
        refused += 1
        s.settimeout(5)
        got = recv_message(s)
        message = message or (got or {}).get("error", {}).get("message", "")
        s.close()
    else:
        kept.append(s)
socks = kept
def in_thread():
    box = []
    def go():
        try:
            box.append(llm_query("from a thread"))
        except Exception as exc:
            box.append(type(exc).__name__ + ": " + str(exc))
    t = threading.Thread(target=go); t.start(); t.join(120)
    return box[0] if box else "no answer"
during = in_thread()
held = llm_query("flooded")
for s in socks:
    s.close()
import time; time.sleep(0.5)
print("FLOOD " + json.dumps({"opened": opened, "refused": refused, "message": message,
                             "ran_out": ran_out, "held_open": len(socks),
                             "during": during, "held": held, "after": in_thread()}))
'''


def seen(req: dict, tag: str) -> dict | None:
    """The JSON a cell printed after ``<tag> `` in any user message of ``req``, or None."""
    for m in req.get("messages") or []:
        if m.get("role") != "user":
            continue
        for line in str(m.get("content") or "").splitlines():
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
    return None
