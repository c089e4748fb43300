"""What a run produced: :class:`Result`, and how one is rebuilt from a journal record."""
from __future__ import annotations

from dataclasses import dataclass, field

from harness.stages.tree import StageTree

#: Result fields kept in the journal's ``usage`` record beside the token/cost totals, so a
#: recorded run returns the same :class:`Result` without running again.
_EXTRA = ("iterations", "cap", "stages", "max_level", "kernels_started", "usage_estimated",
          "sandbox", "kernel_limits")


@dataclass
class Result:
    """What a run produced.

    Attributes:
        answer: the answer set by executed ``FINAL``/``FINAL_VAR`` (str), else None. A run
            a cap stopped has one only if its code set it before the stop (a ``FINAL`` in
            the cell the wall cap interrupted); the model's last reply is never an answer.
        status: ``completed``, ``failed``, ``budget_exceeded`` or ``cancelled``.
        run_id: the run's id (str); the journal key for resume/replay.
        iterations: root loop turns taken (int).
        usage: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` (tokens), ``calls``,
            ``cost_usd`` (USD), plus ``by_model`` and ``by_level`` breakdowns of the same: the
            calls this attempt sent (calls served from the journal are not in it). A resumed
            run adds ``all_attempts``: the same totals over every attempt of the run, as its
            caps count them (a call in flight at a crash at its reservation;
            ``open_at_resume`` says how many).
        reason: why the run ended when it did not complete (str).
        cap: the budget cap that ended it (``cost``, ``tokens``, ``calls``, ``wall``...).
        stages: stage counts by kind (iteration, cell, llm_query, child, fallback...).
        max_level: deepest level reached (int; root = 0).
        kernels_started: kernels started for this run (int): the ones its loops used and the
            pool's idle ones shut down unused.
        seconds: wall time of the run (s).
        replayed_calls: model calls served from the journal (not sent, not charged).
        tree: the :class:`harness.stages.tree.StageTree` (not in :meth:`to_dict`).
        usage_estimated: some model call's reply carried no usage, so its tokens (and cost,
            from the price table) were counted locally with tiktoken: ``usage`` is partly an
            estimate (bool; taken from ``tree`` when not given).
        sandbox: how the run's kernels ran: ``"bwrap"`` (each in its own sandbox, see
            docs/security.md), ``"none"``, ``"mixed"`` (some of each), or None (no kernel).
        kernel_limits: how its sandboxed kernels were bounded: ``"cgroup"`` (each kernel as a
            whole, over all its processes), ``"rlimit"`` (per process: this host may not create
            control groups), ``"mixed"``, or None (no sandboxed kernel). docs/security.md,
            "Limits per kernel".
    """

    answer: str | None
    status: str
    run_id: str
    iterations: int = 0
    usage: dict = field(default_factory=dict)
    reason: str = ""
    cap: str | None = None
    stages: dict = field(default_factory=dict)
    max_level: int = 0
    kernels_started: int = 0
    seconds: float = 0.0
    replayed_calls: int = 0
    tree: StageTree | None = field(default=None, repr=False)
    usage_estimated: bool | None = None
    sandbox: str | None = None
    kernel_limits: str | None = None

    def __post_init__(self) -> None:
        if self.usage_estimated is None:
            self.usage_estimated = self.tree is not None and any(
                s.meta.get("usage_estimated") for s in self.tree.all()
                if s.kind.value == "model_call")

    @property
    def totals(self) -> dict:
        """The run's ``calls``, ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
        ``cost_usd`` over every attempt: ``usage["all_attempts"]`` for a resumed run, else
        ``usage``'s own (the first attempt is all there is)."""
        u = self.usage.get("all_attempts") or self.usage
        return {k: u.get(k, 0) for k in ("calls", "prompt_tokens", "completion_tokens",
                                         "total_tokens", "cost_usd")}

    def to_dict(self) -> dict:
        """A JSON-able dict of every field except ``tree`` (``seconds`` rounded to ms), with
        :attr:`totals`."""
        return {"answer": self.answer, "status": self.status, "run_id": self.run_id,
                "iterations": self.iterations, "usage": self.usage, "totals": self.totals,
                "reason": self.reason,
                "cap": self.cap, "stages": self.stages, "max_level": self.max_level,
                "kernels_started": self.kernels_started, "seconds": round(self.seconds, 3),
                "replayed_calls": self.replayed_calls,
                "usage_estimated": bool(self.usage_estimated), "sandbox": self.sandbox,
                "kernel_limits": self.kernel_limits}

    def journal_usage(self) -> dict:
        """The ``usage`` record the journal keeps for this result (usage plus the counts
        :meth:`from_record` needs to rebuild it)."""
        usage = dict(self.usage)
        for k in _EXTRA:
            usage[k] = getattr(self, k)
        return usage

    @classmethod
    def from_record(cls, record: dict) -> "Result":
        """The recorded result of a finished run (a ``Journal.get_run`` record); nothing is
        run and ``replayed_calls`` is 0."""
        usage = dict(record.get("usage") or {})
        extra = {k: usage.pop(k, None) for k in _EXTRA}
        return cls(answer=record.get("answer"), status=record.get("status") or record["state"],
                   run_id=record["run_id"], iterations=int(extra["iterations"] or 0),
                   usage=usage, reason=record.get("error") or "", cap=extra["cap"],
                   stages=extra["stages"] or {}, max_level=int(extra["max_level"] or 0),
                   kernels_started=int(extra["kernels_started"] or 0), replayed_calls=0,
                   usage_estimated=bool(extra["usage_estimated"]), sandbox=extra["sandbox"],
                   kernel_limits=extra["kernel_limits"])


def usage_summary(tree: StageTree) -> dict:
    """Token, call and cost totals of a stage tree, with ``by_model`` and ``by_level``.

    Returns:
        ``{"prompt_tokens", "completion_tokens", "total_tokens", "calls", "cost_usd",
        "by_model": {model: {...}}, "by_level": {"0": {...}, ...}}`` (tokens, USD).
    """
    total = tree.rollup("run") if "run" in tree else None
    out = total.to_dict() if total is not None else {
        "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "calls": 0, "cost_usd": 0.0}
    out["by_model"] = {m: u.to_dict() for m, u in tree.usage_by_model().items()}
    out["by_level"] = {str(k): u.to_dict() for k, u in tree.usage_by_level().items()}
    return out
