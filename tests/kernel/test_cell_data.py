"""What a cell passes is data: a context handed to ``rlm(...)``/``rlm_batched(...)`` from a
real cell is the child's context as a value, never a host path, a device, a FIFO or the host's
standard input (rlm/core/subcalls.py, :func:`rlm.context.load.load_value`).

One real ``rlm run`` at ``--max-depth 2`` (children with kernels of their own) against the
scripted endpoint, with data piped into its stdin: the root cell hands the children strings
that name the host's stdin, files, a device, a FIFO with no writer (opening it would hang the
host, and this test) and a glob; each child answers with ``repr(context)``.
"""
from __future__ import annotations

import json

from conftest import endpoint_args, is_root, repl

#: What the host's stdin holds: it must reach no child, no model, no answer.
PIPED = "STDIN-SECRET-5d0e piped into rlm run\n"


def test_what_a_cell_passes_to_rlm_is_the_childs_context_never_a_host_path(cli, scripted,
                                                                          tmp_path):
    fifo = tmp_path / "fifo"
    import os
    os.mkfifo(fifo)
    (tmp_path / "host.txt").write_text("HOST-FILE-TEXT")
    names = ["/etc/passwd", "/dev/zero", str(fifo), str(tmp_path / "*.txt"), str(tmp_path)]

    def respond(req):
        if not is_root(req):
            return "plain"
        if "root-question" in json.dumps(req["messages"]):
            return repl("import json", "one = rlm('-', 'what is it?')",
                        f"many = rlm_batched({names!r}, 'what is it?')",
                        "FINAL(json.dumps([one] + many))")
        return repl("FINAL(repr(context))")

    srv = scripted(respond)
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("the root's own context")
    res = cli("run", "--context", str(ctx), "--query", "root-question", *endpoint_args(srv),
              "--max-depth", "2", "-q", "--no-journal", input=PIPED * 20, timeout=180)
    assert res.rc == 0, res.stderr
    assert json.loads(res.stdout) == [repr("-")] + [repr(n) for n in names]
    sent = json.dumps(srv.requests)
    assert "STDIN-SECRET" not in sent and "HOST-FILE-TEXT" not in sent
    assert "root:x:0:0" not in sent  # /etc/passwd's first line
    assert "STDIN-SECRET" not in res.stdout + res.stderr
