"""The evaluation report: trial records in, tables (Markdown, CSV, JSON) and plots out.

A sweep appends one JSON object per trial to ``trials.jsonl`` (keys listed in
docs/benchmarking-depth.md). :func:`write_report` rebuilds
everything else from that file alone, which is what ``rlm eval --report DIR``
runs.
"""
from __future__ import annotations

import csv
import json
import logging
from collections import Counter
from pathlib import Path

from rlm.errors import ConfigError
from rlm.evaluation.identity import mixed_identities
from rlm.evaluation.labels import format_length, series_label, series_order
from rlm.evaluation.needs import check_plotting
from rlm.evaluation.stats import describe, pass_hat_k, wilson_interval
from rlm.evaluation.trial import METHODS

log = logging.getLogger(__name__)

#: The k of the pass^k columns (a k above a row's n gives None there).
PASS_KS = (1, 2, 3, 5, 10)
#: The fields one summary row stands for (a "cell" of the sweep).
GROUP_FIELDS = ("task", "length", "method", "depth", "profile", "model")
#: Keys every trial record must carry for the summary.
REQUIRED = ("task", "length", "method", "score", "correct")
#: Per-trial measures summarised by mean/median/p90: (record key, unit).
MEASURES = (("cost_usd", "USD"), ("tokens", "tokens"), ("wall_s", "seconds"))

TRIALS_FILE = "trials.jsonl"


def read_trials(path: Path) -> list[dict]:
    """Trial records from a JSONL file, one dict per non-blank line, in file order.

    A last line that does not parse is a write cut short by a killed sweep: it is
    skipped with a warning (the sweep runs that trial again on resume). A bad
    line anywhere else means the file is damaged: ConfigError naming the file
    and line number. A missing file is a ConfigError too.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"no trials file {path}; a sweep (`rlm eval ... --out DIR`) "
                          f"writes DIR/{TRIALS_FILE}") from None
    numbered = [(i, line) for i, line in enumerate(raw.split(b"\n"), 1) if line.strip()]
    trials = []
    for lineno, line in numbered:
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if lineno == numbered[-1][0]:
                log.warning("%s:%d: skipping a torn last line (%s)", path, lineno, exc)
                break
            raise ConfigError(f"{path}:{lineno}: not a JSON trial record ({exc}); the file "
                              "is damaged before its last line: fix or delete that line (a "
                              "deleted trial runs again on the next sweep, its journaled calls "
                              "served with no model call)") from None
        problem = (record_problem(record) if isinstance(record, dict) else
                   f"a trial record must be a JSON object, got {type(record).__name__}")
        if problem:
            raise ConfigError(f"{path}:{lineno}: {problem}; fix or delete that line (a deleted "
                              "trial runs again on the next sweep, its journaled calls served "
                              "with no model call)")
        trials.append(record)
    return trials


#: Per-trial counts and measures: None, or a finite number in 0..1e15.
_AMOUNTS = ("prompt_tokens", "completion_tokens", "tokens", "cost_usd", "wall_s", "subcalls",
            "max_depth_reached")


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v \
        and abs(v) < 1e15


def record_problem(r: dict) -> str | None:
    """What makes trial record ``r`` unfit for the report (a hand edit, another tool's file),
    or None: a field of :data:`REQUIRED` missing or of the wrong type, a ``score`` outside
    0..1, ``correct`` that disagrees with it, a negative or non-finite count."""
    missing = [k for k in REQUIRED if k not in r]
    if missing:
        return f"the trial record lacks {', '.join(missing)}"
    checks = (
        (isinstance(r["task"], str), "task must be a string"),
        (isinstance(r["length"], int) and not isinstance(r["length"], bool)
         and r["length"] > 0, "length must be a positive whole number of tokens"),
        (r["method"] in METHODS, f"method must be one of {', '.join(METHODS)}"),
        (r.get("depth") is None or (isinstance(r["depth"], int) and r["depth"] >= 0
                                    and not isinstance(r["depth"], bool)),
         "depth must be a whole number >= 0 or null"),
        (r.get("profile") is None or isinstance(r["profile"], str),
         "profile must be a string or null"),
        (_number(r["score"]) and 0 <= r["score"] <= 1, "score must be a number from 0 to 1"),
        (r["correct"] is (_number(r["score"]) and r["score"] == 1.0),
         "correct must be true exactly when score is 1"),
    )
    for ok, what in checks:
        if not ok:
            return what
    for k in _AMOUNTS:
        if r.get(k) is not None and not (_number(r[k]) and r[k] >= 0):
            return f"{k} must be a number >= 0 or null, got {r[k]!r}"
    return None


def summarize(trials: list[dict]) -> list[dict]:
    """One summary row per (task, length, method, depth, profile, model), sorted.

    Records with the same ``key`` count once (the last one wins). Each row holds
    the group fields, ``series`` (see :func:`series_label`), ``n`` trials,
    ``correct``, ``accuracy`` (correct/n), ``ci_low``/``ci_high`` (95% Wilson
    interval), ``mean_score`` (0..1), ``pass^k`` for k in :data:`PASS_KS` (None
    when k > n), ``{cost_usd,tokens,wall_s}_{mean,median,p90}`` (USD, tokens,
    seconds; None when no trial reported it), ``subcalls_mean``,
    ``max_depth_reached`` (the largest seen), ``truncated`` and ``replayed``
    (counts) and ``failures`` ({kind: count}, "wrong" included). Every trial
    counts in ``n``, whatever its status. Rows are sorted by task, length, then
    base before rlm, depth, profile and model.

    Raises ConfigError when a record lacks one of :data:`REQUIRED`.
    """
    groups: dict[tuple, list[dict]] = {}
    for record in _dedupe(trials):
        groups.setdefault(tuple(record.get(f) for f in GROUP_FIELDS), []).append(record)
    rows = [_row(dict(zip(GROUP_FIELDS, group)), members) for group, members in groups.items()]
    return sorted(rows, key=_sort_key)


def write_report(out_dir: Path, trials: list[dict] | None = None, *,
                 allow_mixed: bool = False) -> dict[str, Path]:
    """Write the summary tables and plots of a sweep into ``out_dir``.

    ``trials`` defaults to the records in ``out_dir/trials.jsonl``; the last record of a key
    counts. Writes summary.md, summary.csv, summary.json, accuracy_vs_length.png,
    cost_vs_depth.png and accuracy_vs_cost.png; returns {file name: path}. With
    ``allow_mixed``, trials whose identities differ in more than the grid's axes are
    reported together, and summary.md says where they differ.

    Raises ConfigError (before writing anything) when matplotlib (the ``[eval]`` extra) is
    not installed, there are no trials, a record is malformed, or the trials' identities
    differ in more than the grid's axes (:func:`rlm.evaluation.identity.mixed_identities`)
    without ``allow_mixed``.
    """
    out_dir = Path(out_dir)
    check_plotting()
    if trials is None:
        trials = read_trials(out_dir / TRIALS_FILE)
    rows = summarize(trials)
    if not rows:
        raise ConfigError(f"no trials to report in {out_dir}")
    mixed = mixed_identities(_dedupe(trials))
    if mixed and not allow_mixed:
        raise ConfigError(
            f"the trials in {out_dir} differ in more than the grid's axes, so they are not one "
            f"measurement: {'; '.join(mixed)}. Run the sweep again (trials whose identity "
            "changed run again), or pass --allow-mixed to report them together")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in ("summary.md", "summary.csv", "summary.json")}
    paths["summary.md"].write_text(markdown_table(rows, mixed), encoding="utf-8")
    _write_csv(paths["summary.csv"], rows)
    _write_json(paths["summary.json"], rows)
    return {**paths, **_write_plots(out_dir, rows)}


def markdown_table(rows: list[dict], mixed: list[str] = ()) -> str:
    """The summary rows as a Markdown document: a short legend and one table; ``mixed``:
    where the trials' identities differ (:func:`rlm.evaluation.identity.mixed_identities`),
    said under the legend."""
    models = {r["model"] for r in rows}
    ks = [k for k in PASS_KS if any(r[f"pass^{k}"] is not None for r in rows)]
    head = ["task", "length", "method"] + (["model"] if len(models) > 1 else []) + [
        "n", "accuracy [95% CI]", "mean score", *[f"pass^{k}" for k in ks],
        "median cost (USD)", "median tokens", "median wall (s)", "failures"]
    lines = [
        f"{sum(r['n'] for r in rows)} trials in {len(rows)} cells. Accuracy is the share of "
        "fully correct answers with its 95% Wilson interval; pass^k estimates the chance "
        "that k repeated trials all succeed.", "",
        _md_line(head), _md_line(["---"] * len(head))]
    if mixed:
        lines[1:1] = ["", "Reported with --allow-mixed: the trials differ in more than the "
                      f"grid's axes: {'; '.join(mixed)}."]
    for r in rows:
        cells = [r["task"], format_length(r["length"]), series_label(r)]
        cells += [str(r["model"])] if len(models) > 1 else []
        cells += [str(r["n"]), f"{r['accuracy']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]",
                  _fmt(r["mean_score"], "{:.2f}"), *[_fmt(r[f"pass^{k}"], "{:.2f}") for k in ks],
                  _fmt(r["cost_usd_median"], "{:.4g}"), _fmt(r["tokens_median"], "{:,.0f}"),
                  _fmt(r["wall_s_median"], "{:.1f}"), _failures_text(r["failures"], ", ") or "–"]
        lines.append(_md_line(cells))
    return "\n".join(lines) + "\n"


def _dedupe(trials: list[dict]) -> list[dict]:
    by_key: dict = {}
    for i, record in enumerate(trials):
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise ConfigError(f"trial record {record.get('key', i)!r} lacks {', '.join(missing)}")
        by_key[record.get("key", ("#", i))] = record
    return list(by_key.values())


def _row(group: dict, members: list[dict]) -> dict:
    n = len(members)
    correct = sum(1 for m in members if m["correct"])
    low, high = wilson_interval(correct, n)
    row = {**group, "series": series_label(group), "n": n, "correct": correct,
           "accuracy": correct / n, "ci_low": low, "ci_high": high,
           "mean_score": describe([m["score"] for m in members])["mean"]}
    row.update({f"pass^{k}": pass_hat_k(correct, n, k) if k <= n else None for k in PASS_KS})
    for key, _unit in MEASURES:
        stats = describe([m[key] for m in members if m.get(key) is not None])
        row.update({f"{key}_{name}": value for name, value in stats.items()})
    row["subcalls_mean"] = describe([m["subcalls"] for m in members
                                     if m.get("subcalls") is not None])["mean"]
    row["max_depth_reached"] = max((m.get("max_depth_reached") or 0 for m in members), default=0)
    row["truncated"] = sum(1 for m in members if m.get("truncated"))
    row["replayed"] = sum(1 for m in members if m.get("replayed"))
    kinds = Counter(m["failure"] for m in members if m.get("failure"))
    row["failures"] = dict(sorted(kinds.items()))
    return row


def _sort_key(row: dict) -> tuple:
    return (str(row["task"]), row["length"], *series_order(row))


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "failures": _failures_text(row["failures"], ";", "=")})


def _write_json(path: Path, rows: list[dict]) -> None:
    doc = {"trials": sum(r["n"] for r in rows), "rows": rows}
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def _write_plots(out_dir: Path, rows: list[dict]) -> dict[str, Path]:
    from rlm.evaluation import plots  # matplotlib: checked by check_plotting first
    return plots.write_plots(out_dir, rows)


def _failures_text(failures: dict, sep: str, joiner: str = " ") -> str:
    return sep.join(f"{kind}{joiner}{count}" for kind, count in failures.items())


def _fmt(value, spec: str) -> str:
    return "–" if value is None else spec.format(value)


def _md_line(cells: list[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
