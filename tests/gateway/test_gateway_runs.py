"""Runs with every kernel on a real Jupyter Kernel Gateway (``conftest.gateway``: another user,
its own files, the project's sandboxed kernelspec), against the scripted model server: recursion,
a fan-out of children, caps under fan-out, tools, replay with no request, a session; and the
provider seam's placement of root and children."""
from __future__ import annotations

import json
import os

import pytest

import rlm
from gw_helpers import USER, gateway, on_gateway  # noqa: F401 (fixtures)
from rlm.api import replay
from scripted_server import ScriptedServer

API_KEY, MODEL = "test-key", "m"


def is_root(req: dict) -> bool:
    msgs = req.get("messages") or []
    return bool(msgs) and msgs[0].get("role") == "system"


def last_user(req: dict) -> str:
    return next((str(m.get("content") or "") for m in reversed(req.get("messages") or [])
                 if m.get("role") == "user"), "")


def repl(*lines: str) -> str:
    return "```repl\n" + "\n".join(lines) + "\n```"


def _turn(req: dict) -> int:
    return sum(1 for m in req["messages"] if m["role"] == "assistant")


def _run(srv, context, query="q", **kw):
    kw.setdefault("journal", False)
    return rlm.completion(context, query, base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                          **kw)


def recursive(req):
    if not is_root(req):
        return "leaf(" + str(len(req["messages"][0]["content"])) + ")"
    if _turn(req) == 0:
        return repl("sub = rlm(context[: len(context) // 2], 'half?')", "print('got', sub)")
    return repl("FINAL('n' + str(len(context)) + '[' + sub + ']')")


@pytest.mark.parametrize("depth", [2, 3])
def test_recursion_with_every_kernel_on_the_gateway(on_gateway, depth):
    with ScriptedServer(recursive) as srv:
        res = _run(srv, "abcdefgh" * 100, max_depth=depth, pool_size=0, **on_gateway)
    assert res.status == "completed", res.reason
    assert res.stages.get("child", 0) == depth - 1 and res.max_level == depth
    # each level's context came over the wire: n800[n400[...[leaf(...)]]]
    assert res.answer.startswith("n800[n400[" + ("n200[" if depth == 3 else "") + "leaf(")
    assert res.sandbox == "gateway"


def test_root_local_children_on_the_gateway(on_gateway):
    def reply(req):
        if not is_root(req):
            return "x"
        if _turn(req) == 0:
            return repl("import os", "print(rlm('abc', 'where?'))")
        if "context" in last_user(req) and _turn(req) == 1:
            return repl("FINAL(os.uname().nodename)")
        return repl("FINAL(os.uname().nodename)")
    with ScriptedServer(reply) as srv:
        res = _run(srv, "ctx", max_depth=2, pool_size=0,
                   **dict(on_gateway, kernels="root=local,children=gateway"))
    assert res.status == "completed", res.reason
    assert res.sandbox == "mixed"  # the root's local sandbox, the child's gateway


def test_fan_out_of_sixty_four_children_on_the_gateway(on_gateway):
    # the fan-out: 64 children, 16 at once, each on a kernel of its own on the gateway
    # (its uid is the gateway's user, which no local kernel has), under a cap of exactly the
    # calls the run needs: every answer right, 0 calls over
    import pwd
    uid = pwd.getpwnam(USER).pw_uid

    def reply(req):
        if not is_root(req):
            return "leaf"
        if "ROOT" in json.dumps(req["messages"][1:2]):
            if _turn(req) == 0:
                return repl("outs = rlm_batched([str(i) for i in range(64)], 'id?')",
                            "print(len(outs))")
            return repl("FINAL(','.join(outs))")
        return repl("import os", "FINAL('c' + context + '@' + str(os.getuid()))")
    with ScriptedServer(reply) as srv:
        res = _run(srv, "ROOT", "ROOT", max_depth=2, max_concurrency=16, pool_size=0,
                   max_calls=2 + 64, **on_gateway)
        sent = srv.count
    assert res.status == "completed", res.reason
    assert res.answer == ",".join(f"c{i}@{uid}" for i in range(64))
    assert res.stages.get("child", 0) == 64 and sent == 2 + 64
    assert res.sandbox == "gateway"


def test_caps_hold_under_a_fan_out_on_the_gateway(on_gateway):
    # 40 sub-calls at once from threads and a batch, against a cap of 12 model calls: the
    # host admits exactly what the cap allows, the rest are refused in the kernel
    cell = repl(
        "import json, threading",
        "got, errs = [], []",
        "def one(i):",
        "    try:",
        "        got.append(llm_query('p%d' % i))",
        "    except BudgetExceeded as e:",
        "        errs.append(e.cap)",
        "ts = [threading.Thread(target=one, args=(i,)) for i in range(20)]",
        "[t.start() for t in ts]; [t.join() for t in ts]",
        "b = llm_query_batched(['q%d' % i for i in range(20)], return_exceptions=True)",
        "ok = len(got) + sum(1 for x in b if isinstance(x, str))",
        "FINAL(json.dumps([ok, len(errs) + sum(1 for x in b if not isinstance(x, str))]))")
    with ScriptedServer(lambda req: cell if is_root(req) else "ans") as srv:
        res = _run(srv, "ctx", max_depth=1, max_calls=12, **on_gateway)
        sent = srv.count
    assert res.status == "completed", res.reason
    ok, refused = json.loads(res.answer)
    assert sent <= 12  # 0 over the cap
    assert ok == sent - 1 and ok + refused == 40


def test_tools_and_replay_with_no_request_on_the_gateway(on_gateway, tmp_path):
    def lookup(name: str) -> dict:
        """A row by name."""
        return {"name": name, "room": len(name)}
    journal = str(tmp_path / "j.sqlite3")

    def reply(req):
        if not is_root(req):
            return "sub:" + last_user(req)[:10]
        if _turn(req) == 0:
            return repl("row = lookup('ada')", "s = llm_query('hello')", "print(row, s)")
        return repl("FINAL(str(row['room']) + s + context)")
    with ScriptedServer(reply) as srv:
        res = _run(srv, "CTX", run_id="gw-tools", journal=journal, tools=[lookup],
                   max_depth=1, **on_gateway)
        assert res.status == "completed", res.reason
        assert res.answer == "3sub:helloCTX"
        sent = srv.count
        again = replay("gw-tools", journal=journal, context="CTX")
        assert (again.status, again.answer) == ("completed", res.answer)
        assert srv.count == sent  # 0 requests: every model call served from the journal


def test_a_session_on_the_gateway(on_gateway, tmp_path):
    # one gateway kernel across the questions: a variable of question 1 used by question 2, and
    # a context added between them pulled into the same kernel by hash
    replies = iter([repl("words = context.split()", "print(len(words))"),
                    repl("FINAL(len(words))"),
                    repl("FINAL(' '.join(reversed(words)) + '|' + context_1.upper())")])

    def reply(req):
        return next(replies) if is_root(req) else "x"
    with ScriptedServer(reply) as srv:
        opts = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, max_depth=1,
                    journal=str(tmp_path / "s.sqlite3"), **on_gateway)
        with rlm.Session("alpha beta gamma", session_id="gw-s", **opts) as s:
            a = s.ask("How many words?")
            kid = s._held.kernel.kernel_id
            assert s.add_context("the appendix") == 1
            b = s.ask("Backwards?")
            assert s._held.kernel.kernel_id == kid
    assert (a.status, b.status) == ("completed", "completed"), (a.reason, b.reason)
    assert (a.answer, b.answer) == ("3", "gamma beta alpha|THE APPENDIX")


def test_a_directory_context_on_the_gateway(on_gateway, tmp_path):
    # a directory as a run's context and as a session's added context: each bound in the
    # gateway kernel as the dict a local kernel binds (keys with their escapes, nested names)
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha")
    (root / "sub" / "b.md").write_text("beta")
    (root / "empty.txt").write_text("")
    with open(os.path.join(os.fsencode(str(root)), b"caf\xe9.txt"), "wb") as f:
        f.write(b"latin")
    keys = "FINAL(','.join(sorted(context)) + '|' + context['sub/b.md'])"
    with ScriptedServer(lambda req: repl(keys)) as srv:
        res = _run(srv, root, max_depth=1, pool_size=0, **on_gateway)
    assert res.status == "completed", res.reason
    assert res.answer == "a.txt,caf\\xe9.txt,empty.txt,sub/b.md|beta"
    with ScriptedServer(lambda req: repl("FINAL(context + '|' + ','.join(sorted(context_1)))")
                        ) as srv:
        with rlm.Session("the text", base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                         max_depth=1, journal=False, **on_gateway) as s:
            assert s.add_context(root) == 1
            got = s.ask("Keys?")
    assert got.answer == "the text|a.txt,caf\\xe9.txt,empty.txt,sub/b.md", got.reason
