"""``rlm chat`` on a real terminal: tmux runs the command in a pseudo-terminal, the test types
into it (keys, arrows, Ctrl-D) and reads the screen; the model is a scripted endpoint on
127.0.0.1."""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from conftest import API_KEY, MODEL, Reply, clean_env, last_user, repl, root_requests, script

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (scripts/test.sh installs it)")


class Tmux:
    """One tmux server of its own (``-L``) running one command in a 160x50 terminal."""

    def __init__(self, command: list[str], env: dict) -> None:
        self.sock, self.env = f"rlm-chat-{uuid.uuid4().hex[:8]}", env
        self._tmux("new-session", "-d", "-s", "chat", "-x", "160", "-y", "50",
                   " ".join(shlex.quote(c) for c in command) + "; sleep 30")

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.sock, *args], env=self.env, check=True,
                              capture_output=True, text=True, timeout=20).stdout

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "chat", *keys)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-t", "chat", "-S", "-200")

    def wait_for(self, text: str, count: int = 1, timeout: float = 40) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = self.screen()
            if s.count(text) >= count:
                return s
            time.sleep(0.1)
        raise AssertionError(f"{text!r} (x{count}) never appeared on the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], env=self.env,
                       capture_output=True, timeout=20)


def test_chat_on_a_terminal_with_line_editing_history_and_added_context(scripted, tmp_path):
    replies = [repl("words = context.split()", "FINAL(len(words))"),
               lambda req: repl(f"FINAL({last_user(req).split('Question: ')[-1]!r})"),
               repl("FINAL(context_1.strip() + ' / ' + str(len(words)))"),
               Reply(content=repl("FINAL('too late')"), delay=3),  # interrupted by Ctrl-C
               repl("FINAL('still here: ' + str(len(words)))")]
    srv = scripted(script(replies))
    (tmp_path / "doc.txt").write_text("one two three four")
    (tmp_path / "more.txt").write_text("extra notes\n")
    env = clean_env(XDG_DATA_HOME=str(tmp_path / "data"), TERM="xterm",
                    RLM_JOURNAL=str(tmp_path / "j.sqlite3"))
    term = Tmux([sys.executable, "-m", "rlm", "chat", "--context", str(tmp_path / "doc.txt"),
                 "--session-id", "tty", "--base-url", srv.base_url, "--api-key", API_KEY,
                 "--model", MODEL, "--cell-timeout", "10"], env)
    try:
        term.wait_for("rlm> ")
        term.keys("how many wrods?", "Enter")
        assert "\n4\n" in term.wait_for("rlm> ", 2)
        # history (Up) and line editing (Left, BSpace): the recalled line, corrected
        term.keys("Up")
        term.keys("Left", "BSpace", "BSpace", "BSpace", "BSpace", "BSpace")
        term.keys("words", "Enter")
        term.wait_for("rlm> ", 3)
        term.keys(f"/add {tmp_path / 'more.txt'}", "Enter")
        term.wait_for("as context_1]")
        term.keys("/bogus", "Enter")
        term.wait_for("unknown command /bogus")
        term.keys("and the notes?", "Enter")
        term.wait_for("extra notes / 4")
        term.keys("a slow one", "Enter")
        time.sleep(1.0)
        term.keys("C-c")
        term.wait_for("[interrupted; the session goes on]")
        term.keys("still there?", "Enter")
        term.wait_for("still here: 4")
        term.keys("C-d")
        screen = term.wait_for("rlm chat --resume tty")
    finally:
        term.close()
    assert "how many words?" in screen  # what the edited line asked (the reply echoes it)
    queries = [m["messages"][-1]["content"] for m in root_requests(srv)]
    assert queries[1].endswith("Question: how many words?")
    assert "`context_1`" in queries[2]
    history = (tmp_path / "data" / "rlm" / "chat_history").read_text()
    assert "how many wrods?" in history and "how many words?" in history


def test_chat_help_and_clear_errors(cli, tmp_path):
    res = cli("chat", "--help")
    assert res.rc == 0 and "/add PATH" in res.stdout and "--resume SESSION_ID" in res.stdout
    assert "--session-max-cost" in res.stdout
    res = cli("chat", "--base-url", "http://127.0.0.1:9/v1", "--api-key", "k", "--model", "m")
    assert res.rc == 2 and "rlm chat needs --context PATH" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    res = cli("chat", "--resume", "ghost", "--journal", str(tmp_path / "none.sqlite3"))
    assert res.rc == 2 and "no journal at" in res.stderr and "Traceback" not in res.stderr
    res = cli("chat", "--context", "-", "--base-url", "http://127.0.0.1:9/v1", "--api-key", "k",
              "--model", "m")
    assert res.rc == 2 and "not on stdin" in res.stderr
