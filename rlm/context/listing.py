"""The metadata of a dict context the root model sees: keys and sizes, never contents.

Up to 40 keys are listed with their sizes; more are summarised by top directory and
extension, with the largest entries. Files that were not loaded (not text), paths that were
not read at all (a symlink out of the named paths, a FIFO, a socket, a device, a symlinked
directory: with the reason of each) and what the walking rules left out (.gitignore, hidden,
--include/--exclude) are counted and named.
"""
from __future__ import annotations

import json

from rlm.context.formats import describe_kind, suffix


def _ignored_text(ignored: dict) -> str:
    return ", ".join(f"{n} {why} (e.g. {', '.join(ex)})" for why, (n, ex) in ignored.items())


def _unread_text(unread: list) -> str:
    """The listing's sentence on the paths not read: each with its reason (by reason, and
    the first 10, past 20 of them)."""
    s = f" Not read: {len(unread)} path(s)"
    if len(unread) > 20:
        reasons: dict[str, int] = {}
        for _, r in unread:
            reasons[r] = reasons.get(r, 0) + 1
        s += f", by reason: {json.dumps(reasons, ensure_ascii=False)}; for example"
    shown = dict(unread[:10 if len(unread) > 20 else 20])
    return s + f": {json.dumps(shown, ensure_ascii=False)}."


def describe_files(info: dict, *, origin: str | None = None, skipped: list = (),
                   ignored: dict | None = None, notes: dict | None = None,
                   show_all: int = 40, unread: list = ()) -> dict:
    """Metadata of a dict context for the system prompt: keys and sizes, never contents.

    ``info`` maps key -> (kind, characters); a kind other than text is described by
    :func:`rlm.context.formats.describe_kind`. With more than ``show_all`` keys the listing
    is shortened to counts per top directory and extension plus the largest entries.
    ``skipped``: ``(key, bytes, reason)`` of files not loaded because not text; ``unread``:
    ``(key, reason)`` of paths not read at all (:func:`rlm.context.sources.collect`).
    Returns :func:`rlm.context.load.describe`'s fields plus ``listing`` (the prompt's text),
    ``skipped`` (both kinds, each ``{"path", "bytes", "reason"}``; ``bytes`` None for a
    path not read) and ``ignored``.
    """
    from rlm.models.tokens import estimate_tokens
    n = len(info)
    chars = sum(c for _, c in info.values())
    lens = {k: c for k, (_, c) in info.items()}
    s = f"it is a dict of {n:,} keys ({chars:,} characters, about {estimate_tokens(chars):,} tokens)"
    if origin:
        s += (f", read from {origin}: each key is a file's path relative to it (sorted), "
              "each value the file's text (str)")
    kinds: dict[str, list] = {}
    for k, (kind, _) in info.items():
        if kind != "text":
            kinds.setdefault(kind, []).append(k)
    if kinds:
        s += "; except " + "; ".join(f"{len(ks)} key(s) whose value is {describe_kind(kd)}"
                                     f" ({', '.join(ks[:3])}{', ...' if len(ks) > 3 else ''})"
                                     for kd, ks in kinds.items())
    s += "."
    if n <= show_all:
        s += f" Characters by key: {json.dumps(lens, ensure_ascii=False)}."
    else:
        groups: dict[str, dict] = {"dir": {}, "ext": {}}
        for k, c in lens.items():
            top = k.split("/", 1)[0] + "/" if "/" in k else "(top level)"
            ext = suffix(k.rsplit("/", 1)[-1]) or "(none)"
            for g, name in (("dir", top), ("ext", ext)):
                v = groups[g].setdefault(name, [0, 0])
                v[0] += 1
                v[1] += c
        for g, label, top in (("dir", "By top directory", 15), ("ext", "By extension", 10)):
            items = sorted(groups[g].items(), key=lambda x: -x[1][1])
            shown = {k: f"{v[0]} files, {v[1]:,} chars" for k, v in items[:top]}
            more = f" and {len(items) - top} more" if len(items) > top else ""
            s += f" {label}: {json.dumps(shown, ensure_ascii=False)}{more}."
        largest = dict(sorted(lens.items(), key=lambda x: -x[1])[:10])
        s += f" Largest (characters): {json.dumps(largest, ensure_ascii=False)}."
        s += f" First keys: {json.dumps(list(lens)[:5], ensure_ascii=False)}."
    if skipped:
        s += f" Not loaded because not text: {len(skipped)} file(s)"
        if len(skipped) > 20:
            reasons: dict[str, int] = {}
            for _, _, r in skipped:
                reasons[r] = reasons.get(r, 0) + 1
            s += (f" ({sum(x[1] for x in skipped):,} bytes), by reason: "
                  f"{json.dumps(reasons, ensure_ascii=False)}; for example")
        shown = {k: f"{r}, {size:,} bytes" for k, size, r in skipped[:10 if len(skipped) > 20 else 20]}
        s += f": {json.dumps(shown, ensure_ascii=False)}."
    if unread:
        s += _unread_text(list(unread))
    if ignored:
        s += f" Left out by rule: {_ignored_text(ignored)}."
    if notes:
        items = list(notes.items())
        s += " Notes: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in items[:10])
        s += f" and {len(items) - 10} more." if len(items) > 10 else "."
    keys = list(lens)[:50]
    return {"type": "dict", "chars": chars, "tokens_estimate": estimate_tokens(chars), "items": n,
            "item_chars": {k: lens[k] for k in keys}, "listing": s,
            "skipped": [{"path": k, "bytes": size, "reason": r} for k, size, r in skipped]
            + [{"path": k, "bytes": None, "reason": r} for k, r in unread],
            "ignored": {why: n for why, (n, _) in (ignored or {}).items()}}
