"""The live view of a run: a ``rich`` display on a terminal, plain lines anywhere else.

During ``rlm run`` the display is a :class:`harness.stages.tree.StageTree` listener (it sees every
stage change as it happens) plus the ``on_progress`` callback. ``rlm show RUN_ID --follow`` and
``rlm runs --watch`` build the same picture from the journal of a run going on in another
process, by reading it again every interval.

Modes (:func:`make_display`): ``-q`` prints nothing; ``-v``, ``--plain`` or a stderr that is not
a terminal prints plain ``[rlm] ...`` lines (progress messages, and one line per iteration,
child, failure or budget stop as it ends); otherwise a live panel shows the active stages as a
tree (what each is doing, for how long), tokens, cost and calls against each cap, and the
elapsed time.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import IO, Any, Mapping

from harness.budget.caps import CAPS

__all__ = ["LiveState", "make_display", "plain_line", "follow_run", "watch_runs"]

_TERMINAL = {"completed", "failed", "cancelled", "budget_exceeded"}
_DOING = {"model_call": "waiting for the model", "cell": "executing code",
          "llm_query": "sub-call", "fallback": "fallback completion (depth limit)",
          "child": "child RLM", "iteration": "iteration", "run": "run", "tool": "tool call",
          "compaction": "compacting the conversation"}
_STYLE = {"completed": "green", "failed": "red", "budget_exceeded": "dark_orange",
          "cancelled": "grey50", "running": "cyan", "pending": "grey62", "crashed": "red"}


#: How the live view writes an amount of each cap unit (see :data:`harness.budget.caps.CAPS`).
_SHOW = {"tokens": lambda x: f"{int(x):,}", "USD": lambda x: f"${x:.4f}",
         "calls": lambda x: f"{int(x)}", "s": lambda x: f"{x:.0f} s"}


class LiveState:
    """What the live view knows of one run: active stages and usage so far. Thread-safe."""

    def __init__(self, caps: Mapping[str, Any] | None = None, clock=time.time) -> None:
        caps = caps or {}
        self.caps = {cap.field: caps.get(cap.field) for cap in CAPS}
        self.clock = clock
        self.t0: float | None = None
        self.run_id: str | None = None
        self.active: dict[str, dict] = {}      # non-terminal stages by id
        self.own: dict[str, tuple] = {}        # (in, out, calls, cost) of each stage seen
        self.totals = [0, 0, 0, 0.0]
        self.n_stages = 0
        self.problems: list[str] = []          # lines about failed/stopped stages
        self.ended: str | None = None          # why the run ended, when not with an answer
        self.tool_calls: set[str] = set()      # tool stages that called their tool
        self._lock = threading.Lock()

    def update(self, stage: Mapping, ts: float | None = None) -> None:
        """Take the latest record of one stage (from a listener event or the journal)."""
        sid = stage["id"]
        with self._lock:
            if sid not in self.own:
                self.n_stages += 1
            if self.t0 is None or sid == "run":
                self.t0 = stage.get("started_at") or stage.get("created_at") or ts or self.t0
            new = (stage.get("prompt_tokens") or 0, stage.get("completion_tokens") or 0,
                   stage.get("calls") or 0, float(stage.get("cost_usd") or 0.0))
            old = self.own.get(sid, (0, 0, 0, 0.0))
            for k in range(4):
                self.totals[k] += new[k] - old[k]
            self.own[sid] = new
            if (stage.get("kind") == "tool" and stage.get("started_at")
                    and not (stage.get("meta") or {}).get("replayed")):
                self.tool_calls.add(sid)
            if stage.get("status") in _TERMINAL:
                was = self.active.pop(sid, None)
                if stage.get("kind") == "run":
                    self.ended = plain_line(stage, None, self.run_id)
                elif stage.get("status") in ("failed", "budget_exceeded") and (
                        was is not None or stage.get("kind") != "model_call"):
                    self.problems.append(plain_line(stage, was and was.get("status")) or sid)
                    del self.problems[:-5]
            else:
                self.active[sid] = dict(stage)

    def snapshot(self) -> tuple[list[dict], list, int, list[str], float | None]:
        """A consistent copy for one redraw: (active stage dicts, usage totals ``[prompt
        tokens, completion tokens, calls, USD]``, stages seen, the last lines about failed or
        stopped stages, the run's start as epoch seconds or None)."""
        with self._lock:
            return (list(self.active.values()), list(self.totals), self.n_stages,
                    list(self.problems), self.t0)

    # -------------------------------------------------------------- rendering (rich)

    def renderable(self, title: str = "", now: float | None = None, max_rows: int = 30):
        """A ``rich`` renderable: header, caps with usage, the tree of active stages."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text
        from rich.tree import Tree
        now = self.clock() if now is None else now
        active, (tin, tout, calls, cost), n, problems, t0 = self.snapshot()
        elapsed = now - t0 if t0 else 0.0
        head = Text.assemble((title or f"run {self.run_id or ''}", "bold"),
                             f"  {elapsed:.1f} s elapsed · {n} stages · {len(active)} active")
        caps = Table.grid(padding=(0, 2))
        row = []
        used_by = {"tokens": tin + tout, "cost": cost, "calls": calls, "wall": elapsed,
                   "tool_calls": len(self.tool_calls)}
        for c in CAPS:
            label, used, cap, fmt = c.name, used_by[c.name], self.caps[c.field], _SHOW[c.unit]
            if cap:
                pct = min(100.0, 100.0 * used / cap)
                style = "red" if pct >= 90 else "dark_orange" if pct >= 70 else "green"
                row.append(Text.assemble(f"{label} {fmt(used)} / {fmt(cap)} ",
                                         (f"{pct:3.0f}%", style)))
            else:
                row.append(Text(f"{label} {fmt(used)}"))
        caps.add_row(*row)
        by_id = {s["id"]: s for s in active}
        tree = Tree(Text("active stages", style="dim"))
        nodes: dict[str, Any] = {}
        shown = 0
        for s in sorted(active, key=lambda s: (s["id"].count("/"), s.get("created_at") or 0)):
            if shown >= max_rows:
                break
            parent = s.get("parent_id")
            while parent is not None and parent not in by_id:
                parent = parent.rsplit("/", 1)[0] if "/" in parent else None
            if parent is not None and parent not in nodes:
                continue  # its parent row was cut: keep the tree honest
            start = s.get("started_at")
            secs = f"{now - start:.1f} s" if start else "queued"
            label = Text.assemble((s["id"].rsplit("/", 1)[-1], "bold"), " ",
                                  (s.get("status") or "", _STYLE.get(s.get("status"), "")),
                                  f" · {_DOING.get(s.get('kind'), s.get('kind'))}"
                                  f"{' ' + s['model'] if s.get('model') and s.get('kind') == 'model_call' else ''}"
                                  f" · L{s.get('level', 0)} · {secs}")
            nodes[s["id"]] = (nodes[parent] if parent is not None else tree).add(label)
            shown += 1
        parts: list[Any] = [head, caps, tree]
        if len(active) > shown:
            parts.append(Text(f"... and {len(active) - shown} more active stages", style="dim"))
        for p in problems:
            parts.append(Text(p, style="red"))
        if self.ended:
            parts.append(Text(self.ended, style="bold red"))
        return Group(*parts)


def plain_line(stage: Mapping, prev: str | None = None, run_id: str | None = None, *,
               short: bool = False) -> str | None:
    """The plain progress line for a stage that reached ``stage['status']``, or ``None`` when
    that change is not worth a line (a finished sub-call or model call, a started stage, the
    run's answer). The ``run`` stage's line, when the run ends without an answer, says why
    (:func:`rlm.observe.summary.stage_ending`; ``run_id`` names it in the advice to resume);
    ``short``: without the stage's error (the ``run`` stage's: without the recorded reason),
    for a reason said on another line."""
    st, kind, sid = stage.get("status"), stage.get("kind"), stage.get("id", "?")
    if st not in _TERMINAL:
        return None
    start, end = stage.get("started_at"), stage.get("ended_at")
    took = f" in {end - start:.2f} s" if start and end else ""
    err = (stage.get("error") or "").replace("\n", " ")
    err = f": {err[:160]}" if err and st != "completed" and not short else ""
    ev = stage.get("evidence") if isinstance(stage.get("evidence"), dict) else {}
    notes = ", ".join(n for n, f in (("timed out", ev.get("timed_out")),
                                     ("interrupted", ev.get("interrupted")),
                                     ("kernel died", ev.get("died"))) if f)
    notes = f" ({notes})" if notes else ""
    if kind == "run":  # the run's end, when it is not an answer, says why (the summary)
        if st == "completed":
            return None
        from rlm.observe.summary import stage_ending
        end = stage_ending(stage, run_id or "")
        return f"run {run_id or sid} ended{took}: {(end.head or end.text) if short else end.text}"
    if kind in ("iteration", "child") or st != "completed" or (kind == "cell" and notes):
        return f"L{stage.get('level', 0)} {kind} {sid} {st}{notes}{took}{err}"
    return None


class _Quiet:
    listener = staticmethod(lambda event: None)
    progress = staticmethod(lambda msg: None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Plain(_Quiet):
    """``[rlm] ...`` lines on a stream: progress messages and stage ends worth a line."""

    #: how long a failed stage's line waits to learn whether its failure ends the run (s)
    HOLD = 5.0

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.state = LiveState()
        self._lock = threading.Lock()
        # a failure is said once: the line of a failed stage waits (``_held``: its line with
        # and without the error, and the error) until the next line shows whether the
        # failure ends the run, whose last line (``rlm: error: ...``) then says it; else
        # the first held line says it, the others (its parents, failing the same way) not
        self._held: list[tuple[str, str, str]] = []
        self._said: set[str] = set()
        self._timer: threading.Timer | None = None

    def _write(self, text: str) -> None:
        with self._lock:
            try:
                print(f"[rlm] {text}", file=self.stream, flush=True)
            except (OSError, ValueError):
                pass

    def progress(self, msg: str) -> None:
        self._flush()
        self._write(msg)

    def __exit__(self, *exc) -> None:
        self._flush()

    def _flush(self, ended: str | None = None) -> None:
        """Write the held lines: each without its error when the run ended with it
        (``ended``: the run's reason; its last line says it) or it was said already; else
        the first one with it."""
        with self._lock:
            held, self._held = self._held, []
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for full, short, err in held:
                same = _same(err, ended or "")
                text = short if same or any(_same(err, x) for x in self._said) else full
                self._said.add(err)
                try:
                    print(f"[rlm] {text}", file=self.stream, flush=True)
                except (OSError, ValueError):
                    pass

    def listener(self, event: dict) -> None:
        try:
            if event.get("event") == "rollback":
                return
            stage = event["stage"]
            self.state.update(stage, event.get("ts"))
            if event.get("event") == "transition":
                self._line(stage, event.get("from"), event.get("run_id"))
        except Exception:  # a display must never break the run (listeners roll back)
            pass

    def _line(self, stage: Mapping, prev: str | None, run_id: str | None) -> None:
        line = plain_line(stage, prev, run_id)
        if not line:
            return
        kind, err = stage.get("kind"), _reason(stage.get("error"))
        so_far = ""
        if kind == "iteration":
            tin, tout, calls, cost = self.state.snapshot()[1]
            so_far = f" · so far {calls} calls, {tin + tout:,} tokens, ${cost:.4f}"
        if kind == "run":  # the run ended without an answer: its last line says why
            self._flush(ended=err)
            self._write(plain_line(stage, prev, run_id, short=True) or line)
            return
        if not err or stage.get("status") == "completed":
            self._flush()
            self._write(line + so_far)
            return
        short = (plain_line(stage, prev, run_id, short=True) or line) + so_far
        with self._lock:
            if self._held and not _same(self._held[-1][2], err):
                pass  # another failure: the held ones are not this one's parents
            else:
                self._held.append((line + so_far, short, err))
                if self._timer is None:
                    self._timer = threading.Timer(self.HOLD, self._flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
        self._flush()
        self._line(stage, prev, run_id)


def _reason(error: Any) -> str:
    """A stage's error as the failures of its parents repeat it: on one line, without the
    exception class names in front (``SubcallError: UnfinishedToolCall: ...``), its first 80
    characters (a parent may hold it cut)."""
    text = " ".join(str(error or "").split())
    while True:
        head, sep, rest = text.partition(": ")
        if not (sep and head.isidentifier() and head[:1].isupper()):
            return text[:80]
        text = rest


def _same(a: str, b: str) -> bool:
    """Whether two :func:`_reason` keys are one failure's (one may be cut shorter)."""
    return bool(a) and bool(b) and (a.startswith(b) or b.startswith(a))


class _Rich(_Quiet):
    """A ``rich`` live panel on a terminal, refreshed four times a second."""

    def __init__(self, stream: IO[str], caps: Mapping[str, Any] | None) -> None:
        from rich.console import Console
        self.console = Console(file=stream, stderr=True)
        self.state = LiveState(caps)
        self._live = None

    def __enter__(self):
        from rich.live import Live
        self._live = Live(console=self.console, refresh_per_second=4, transient=True,
                          get_renderable=self.state.renderable)
        self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        for p in self.state.snapshot()[3] + ([self.state.ended] if self.state.ended else []):
            self.console.print(f"[rlm] {p}", style="red", markup=False, highlight=False)

    def progress(self, msg: str) -> None:
        # rich's Live places the cursor under its lock but writes a print after releasing
        # it; a refresh from its own thread in between leaves a stale copy of the panel on
        # the screen. Holding that lock across the print makes it one write.
        live = self._live
        with getattr(live, "_lock", None) or contextlib.nullcontext():
            self.console.print(f"[rlm] {msg}", markup=False, highlight=False)

    def listener(self, event: dict) -> None:
        try:
            if event.get("event") == "rollback":
                return
            self.state.run_id = event.get("run_id")
            self.state.update(event["stage"], event.get("ts"))
        except Exception:
            pass


def make_display(*, quiet: bool = False, verbose: bool = False, plain: bool = False,
                 stream: IO[str], caps: Mapping[str, Any] | None = None):
    """The progress display for one run: an object with ``progress(msg)``, ``listener(event)``
    and a context manager that starts and stops it."""
    if quiet:
        return _Quiet()
    isatty = getattr(stream, "isatty", lambda: False)
    if verbose or plain or not isatty():
        return _Plain(stream)
    return _Rich(stream, caps)


# ------------------------------------------------------------------ following the journal


def _caps_of(rec: Mapping) -> dict:
    return dict(((rec.get("options") or {}).get("budget") or {}))


def follow_run(journal, run_id: str, *, interval: float = 0.5, max_level: int | None = None,
               stream: IO[str] | None = None, out: IO[str] | None = None) -> int:
    """Follow a run from its journal until it is no longer running, then print its tree.

    On a terminal the live panel is shown; otherwise one plain line per stage change worth a
    line (as during ``rlm run``). Returns 0 (2 for an unknown run, via ``ConfigError``).
    """
    import sys

    from rlm.errors import ConfigError
    stream = stream or sys.stderr
    out = out or sys.stdout
    rec = journal.get_run(run_id)
    if rec is None:
        raise ConfigError(f"no run {run_id!r} in journal {journal.path}; list runs with `rlm runs`")
    state = LiveState(_caps_of(rec))
    state.run_id = run_id
    seen: dict[str, str] = {}
    display = make_display(stream=stream, caps=_caps_of(rec))
    rich_mode = isinstance(display, _Rich)
    if rich_mode:
        display.state = state
    try:
        with display:
            while True:
                rec = journal.get_run(run_id) or rec
                for st in journal.stages(run_id):
                    prev = seen.get(st["id"])
                    if prev == st.get("status"):
                        continue
                    seen[st["id"]] = st.get("status")
                    state.update(st)
                    if not rich_mode:
                        line = plain_line(st, prev, run_id)
                        if line:
                            display.progress(line)
                if rec["state"] != "running":
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        print(f"[rlm] stopped following run {run_id} (it goes on)", file=stream)
        return 0
    from rlm.observe.summary import show_lines
    for line in show_lines(journal, rec, max_level):  # as `rlm show` prints it
        print(line, file=out)
    out.flush()
    return 0


def _runs_table(journal, limit: int):
    """The runs list as a ``rich`` table: the rows and columns ``rlm runs`` prints
    (:func:`rlm.observe.summary.run_row`); a run id is never wrapped or cut."""
    from rich.markup import escape
    from rich.table import Table

    from rlm.observe.summary import RUN_COLUMNS, run_row
    t = Table(title=f"runs in {journal.path}", title_justify="left", box=None)
    for head, key, right in RUN_COLUMNS:
        t.add_column(head, justify="right" if right else "left",
                     no_wrap=key in ("run_id", "started", "state"))
    for r in journal.list_runs(limit=limit):
        row = run_row(journal, r)  # printable already; no rich markup either
        t.add_row(*[f"[{_STYLE.get(r['state'], '')}]{escape(row[key])}[/]" if key == "state"
                    else escape(row[key]) for _, key, _ in RUN_COLUMNS])
    return t


def watch_runs(journal, *, limit: int = 20, interval: float = 1.0,
               stream: IO[str] | None = None) -> int:
    """``rlm runs --watch``: the runs list, refreshed every ``interval`` seconds until Ctrl-C
    (a live table on a terminal; a fresh table per refresh otherwise)."""
    import sys

    from rich.console import Console
    stream = stream or sys.stdout
    console = Console(file=stream)
    if not console.is_terminal:  # a pipe or a file: no wrapping of run ids at 80 columns
        console = Console(file=stream, width=200)
    try:
        if console.is_terminal:
            from rich.live import Live
            with Live(_runs_table(journal, limit), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(_runs_table(journal, limit), refresh=True)
        while True:
            console.print(_runs_table(journal, limit))
            stream.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
