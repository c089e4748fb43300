"""Benchmark: the journal's overhead per stage, in microseconds.

One "stage" = what the host journals for one model call: three ``record_event`` calls (creation
-> pending, pending -> running, running -> completed; the completed stage carries ~400 characters
of evidence) plus one ``record_model_call`` (a ~2 kB request, a ~400-character response). Run on a
fresh journal in a temporary directory, single-threaded and with N threads sharing one
``Journal`` (the fan-out case: ``llm_query_batched`` / ``rlm_batched``).

Reported per configuration (median of ``--repeat`` runs):

- ``wall/stage``: elapsed wall time divided by stages journaled, i.e. the amortised cost
  (includes SQLite's periodic WAL checkpoints, which fsync);
- ``p50``/``p99``/``max``: latency of one stage's four writes as the calling thread sees it (with N
  threads this includes waiting for the other threads' writes).

``--compare-connections`` also measures the alternative this module rejected: one SQLite
connection per thread (``threading.local``) with no Python lock, where threads contend on SQLite's
own file lock and its sleeping busy handler.

``--postgres`` measures the same on PostgreSQL too: a throwaway local server
(``evals.pg_server``; or ``--postgres-url URL`` for an existing one), a fresh schema per
measurement. ``--chain`` also measures each store with the hash chain switched off (no chain head
read, no run lock, no hashing), so the difference is the chain's cost per stage. ``--spend`` adds
a run's two spend rows per stage (the reservation before the call, the settlement after) and
measures them each committed against written behind (``harness.journal.behind``: the
reservation commits with the queued records, the rest waits).

    python -m evals.bench_journal [--stages 2000] [--threads 16] [--repeat 3]
                                  [--compare-connections] [--postgres | --postgres-url URL]
                                  [--chain] [--spend]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time

from harness.journal import Journal, request_hash
from harness.journal.journal import PostgresJournal, SQLiteJournal


def _stage(run_id: str, i: int, status: str) -> dict:
    return {"id": f"{run_id}/iteration-0/model_call-{i}", "parent_id": f"{run_id}/iteration-0",
            "kind": "model_call", "level": 0, "ordinal": i, "status": status,
            "model": "qwen2.5-coder-0.5b", "created_at": time.time(), "started_at": None,
            "ended_at": None, "prompt_tokens": 812, "completion_tokens": 120, "cost_usd": 0.0004,
            "error": None, "evidence": {"response": "x" * 400} if status == "completed" else None,
            "meta": {"chunk": i}}


_REQUEST_TEXT = "y" * 2000


def journal_one_stage(j: Journal, run_id: str, i: int) -> None:
    """Journal one model-call stage: 3 transitions and the call's request/response (with
    ``--spend``, as a run journals it: also its reservation, before it is "sent", and its
    settlement; ``_behind`` journals write all but the reservation behind)."""
    behind = getattr(j, "_behind", None)
    spend = behind is not None
    call_id = f"{run_id}/iteration-0/model_call-{i}"
    for frm, to in ((None, "pending"), ("pending", "running"), ("running", "completed")):
        if spend and to == "running":
            j.record_spend(run_id, call_id, f"r{i}", "reserved", model="m", calls=1,
                           prompt_tokens=900, completion_tokens=256)
        j.record_event({"run_id": run_id, "stage": _stage(run_id, i, to), "from": frm, "to": to,
                        "ts": time.time()}, behind=bool(behind))
    req = {"model": "qwen2.5-coder-0.5b", "max_tokens": 256,
           "messages": [{"role": "user", "content": _REQUEST_TEXT}]}
    j.record_model_call(run_id, call_id,
                        request_hash=request_hash(req), request=req,
                        response={"text": "x" * 400, "finish_reason": "stop"},
                        usage={"prompt_tokens": 812, "completion_tokens": 120},
                        attempts=[{"n": 1, "seconds": 1.2}], behind=bool(behind))
    if spend:
        j.record_spend(run_id, call_id, f"r{i}", "settled", model="m", calls=1,
                       prompt_tokens=812, completion_tokens=120, behind=bool(behind))


class _EachCommitted(SQLiteJournal):
    """A run's records of one call (``--spend``), each in its own transaction."""

    _behind = False


class _WrittenBehind(SQLiteJournal):
    """A run's records of one call (``--spend``), as a run writes them: the reservation
    durable (carrying the queued records), the rest written behind."""

    _behind = True


class _Unchained:
    """The journal without its hash chain (for measuring the chain's cost only): the same event
    append (statements, round trips), with no head lookup, no hashing and NULL chain columns."""

    def _event_digest(self, prev, ev):  # type: ignore[override]
        return None

    def _chain_head(self, conn, run_id):  # type: ignore[override]
        return None


class _UnchainedSQLite(_Unchained, SQLiteJournal):
    pass


class _UnchainedPostgres(_Unchained, PostgresJournal):
    pass


class _PerThreadJournal(SQLiteJournal):
    """The rejected alternative: one connection per thread, SQLite's locking only."""

    def __init__(self, *args, **kwargs) -> None:
        self._local = threading.local()
        self._extra: list = []
        super().__init__(*args, **kwargs)

    def _locked(self):  # type: ignore[override]
        return contextlib.nullcontext()

    def _connection(self):  # type: ignore[override]
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._open()
            self._extra.append(conn)
        return conn

    def close(self) -> None:
        for conn in self._extra:
            conn.close()
        super().close()


_PG_URL: str | None = None  # the server of the PostgreSQL measurements


def run_once(cls: type[Journal], threads: int, stages: int) -> tuple[float, float, float, float]:
    """Journal ``stages`` stages spread over ``threads`` threads on a fresh file (or a fresh
    PostgreSQL schema).

    Returns (wall µs per stage, p50, p99 and max µs of one stage's latency).
    """
    per_thread = max(1, stages // threads)
    with tempfile.TemporaryDirectory() as tmp:
        if issubclass(cls, PostgresJournal):
            from evals.pg_server import fresh_schema
            j = cls(fresh_schema(_PG_URL))
        else:
            j = cls(os.path.join(tmp, "journal.sqlite3"))
        try:
            for t in range(threads):
                j.create_run(f"run-{t}", query="q", model="m")
            latencies: list[float] = []
            barrier = threading.Barrier(threads + 1)

            def work(t: int) -> None:
                mine = []
                barrier.wait()
                for i in range(per_thread):
                    start = time.perf_counter()
                    journal_one_stage(j, f"run-{t}", i)
                    mine.append(time.perf_counter() - start)
                latencies.extend(mine)

            workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
            for w in workers:
                w.start()
            barrier.wait()
            start = time.perf_counter()
            for w in workers:
                w.join()
            elapsed = time.perf_counter() - start
        finally:
            j.close()
    latencies.sort()
    n = len(latencies)
    return (elapsed / n * 1e6, latencies[n // 2] * 1e6, latencies[min(n - 1, int(n * 0.99))] * 1e6,
            latencies[-1] * 1e6)


def measure(cls: type[Journal], threads: int, stages: int, repeat: int) -> tuple[float, ...]:
    runs = [run_once(cls, threads, stages) for _ in range(repeat)]
    return tuple(statistics.median(r[k] for r in runs) for k in range(3)) + (
        max(r[3] for r in runs),)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2000, help="stages per measurement")
    parser.add_argument("--threads", type=int, default=16, help="threads for the fan-out case")
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration (median)")
    parser.add_argument("--compare-connections", action="store_true",
                        help="also measure one connection per thread (the rejected design)")
    parser.add_argument("--postgres", action="store_true",
                        help="also measure PostgreSQL on a throwaway local server")
    parser.add_argument("--postgres-url", metavar="URL",
                        help="also measure PostgreSQL on this server (a schema per run)")
    parser.add_argument("--chain", action="store_true",
                        help="also measure each store without the hash chain")
    parser.add_argument("--spend", action="store_true",
                        help="also measure SQLite with a run's spend rows, each record committed "
                             "vs written behind (one commit per call)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        global _PG_URL
        if args.postgres_url:
            _PG_URL = args.postgres_url
        elif args.postgres:
            from evals.pg_server import temporary_server
            _PG_URL = stack.enter_context(temporary_server(durable=True))
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    variants: list[tuple[str, type[Journal]]] = [("SQLite: shared connection + lock (Journal)",
                                                  SQLiteJournal)]
    if args.chain:
        variants.append(("SQLite without the hash chain", _UnchainedSQLite))
    if args.spend:
        variants.append(("SQLite, with spend rows, each record committed", _EachCommitted))
        variants.append(("SQLite, with spend rows, written behind (as a run)", _WrittenBehind))
    if args.compare_connections:
        variants.append(("SQLite: connection per thread (rejected)", _PerThreadJournal))
    if _PG_URL:
        variants.append(("PostgreSQL (local server)", PostgresJournal))
        if args.chain:
            variants.append(("PostgreSQL without the hash chain", _UnchainedPostgres))
    print(f"journal overhead per stage (3 record_event + 1 record_model_call), "
          f"{args.stages} stages, median of {args.repeat}; cpus={os.cpu_count()}, "
          f"python {sys.version.split()[0]}")
    for name, cls in variants:
        print(f"\n{name}")
        for threads in (1, args.threads):
            wall, p50, p99, worst = measure(cls, threads, args.stages, args.repeat)
            print(f"  {threads:>2} thread{'s' if threads > 1 else ' '}: wall/stage {wall:6.0f} us"
                  f"   latency p50 {p50:6.0f} us  p99 {p99:7.0f} us  max {worst:8.0f} us",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
