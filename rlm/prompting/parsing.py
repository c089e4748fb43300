"""Parsing model replies: reasoning sections, fenced code blocks to run, and FINAL in prose.

Reasoning is not code. A reply may carry the model's reasoning inside its content, between
tags such as ``<think>...</think>`` (DeepSeek-R1, Qwen3, QwQ), ``<thinking>``, ``<thought>``,
``<reasoning>``, ``<reflection>``, ``<seed:think>`` (Seed-OSS), ``[THINK]...[/THINK]``
(Magistral), ``◁think▷...◁/think▷`` (Kimi), ``<|begin_of_thought|>...<|end_of_thought|>``
(OpenThoughts, Sky-T1), or gpt-oss's raw ``<|channel|>analysis<|message|>...<|end|>``. Those
sections are cut out of the reply before anything else looks at it: nothing in them runs,
nothing in them becomes the answer or a prose ``FINAL``. A section opened and never closed
(a reply cut while reasoning) runs to the end of the reply. A closing tag with no opening tag
before it (servers whose chat template already opened the section in the prompt) makes
everything before it reasoning. Tags inside a code block are code, not reasoning.

Code blocks follow CommonMark's fences: an opening line of at least three backticks or tildes
(indented by any whitespace) with an info string naming the language, and a closing line of
the *same* character, *at least as long*, with nothing after it but spaces. So ```` ```` ````
blocks can hold ```` ``` ```` lines, ``~~~`` blocks can hold backticks, and a line like
```` ```json ```` inside a block is content, never its end. One step past CommonMark, for how
models really write code: inside a Python block a closing-fence line that sits inside an open
triple-quoted string (a markdown example held in a string) is content too; only if that leaves
the block unclosed is the first closing-fence line taken after all.

Only ``repl``, ``python``, ``py``, ``python3``, ``ipython`` blocks run. A block whose closing
fence is missing at the end of the reply runs, unless the reply was cut at the output-token
limit (``cut=True``): then it was cut mid-way and never runs.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

#: Languages (first word of a fence's info string) whose blocks run.
CODE_LANGS = frozenset({"repl", "python", "py", "python3", "ipython", "ipython3"})

#: Reasoning fields of a chat message besides ``content``: DeepSeek, vLLM and llama.cpp send
#: ``reasoning_content``; OpenRouter, vLLM (newer) and Ollama send ``reasoning``; some proxies
#: ``thinking``. OpenRouter's ``reasoning_details`` is a list of ``{"text"|"summary"}``.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking", "reasoning_details")

#: (opening tag, closing tag) regexes of reasoning sections inside content.
_REASONING_TAGS: list[tuple[str, str]] = [
    (r"<(?P<tag>think|thinking|thought|thoughts|reasoning|reflection)(?:\s[^<>]*)?>",
     r"</{tag}\s*>"),
    (r"<seed:think>", r"</seed:think>"),
    (r"\[THINK\]", r"\[/THINK\]"),
    (r"◁think▷", r"◁/think▷"),
    (r"<\|begin_of_thought\|>", r"<\|end_of_thought\|>"),
    (r"<\|channel\|>\s*analysis\s*<\|message\|>", r"<\|end\|>|(?=<\|start\|>|<\|channel\|>)"),
]
_OPEN = re.compile("|".join(f"(?P<o{i}>{o})" for i, (o, _) in enumerate(_REASONING_TAGS)),
                   re.IGNORECASE)
_ORPHAN_CLOSE = re.compile(r"</(think|thinking|thought|thoughts|reasoning)\s*>|</seed:think>|"
                           r"\[/THINK\]|◁/think▷|<\|end_of_thought\|>", re.IGNORECASE)
#: gpt-oss's final channel header, left in front of the visible text once the analysis is cut.
_FINAL_CHANNEL = re.compile(r"<\|start\|>assistant|<\|channel\|>\s*final\s*<\|message\|>|"
                            r"<\|(?:return|end)\|>", re.IGNORECASE)

_OPENER = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n]*)$")
_PROSE_FINAL = re.compile(r"\bFINAL(?:_VAR)?\s*\(", re.DOTALL)


@dataclass
class Block:
    """One fenced block of a reply.

    Attributes:
        code: its content (the opener's indentation removed from each line).
        lang: first word of the info string, lower-case ("" for none).
        closed: the block ended at a closing fence (False: it ran to the end of the reply).
    """

    code: str
    lang: str
    closed: bool

    @property
    def runs(self) -> bool:
        return self.lang in CODE_LANGS and bool(self.code.strip())


@dataclass
class ParsedReply:
    """A reply taken apart.

    Attributes:
        text: the reply without its reasoning sections (what the model "said").
        reasoning: the reasoning sections' text, in order (list of str).
        blocks: every fenced block of ``text`` in order, runnable or not (:class:`Block`).
        prose: ``text`` outside every block.
    """

    text: str
    reasoning: list[str] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    prose: str = ""

    def code_blocks(self, cut: bool = False) -> list[str]:
        """The code of every block that runs; with ``cut`` (the reply hit the output-token
        limit) an unclosed last block is left out."""
        return [b.code for b in self.blocks if b.runs and (b.closed or not cut)]

    def prose_final(self) -> bool:
        """True if the reply writes FINAL(...)/FINAL_VAR(...) outside every code block and
        outside its reasoning."""
        return bool(_PROSE_FINAL.search(self.prose))

    def unclosed_code(self) -> bool:
        """True if the last block is a code block with no closing fence."""
        return bool(self.blocks) and self.blocks[-1].runs and not self.blocks[-1].closed


# --------------------------------------------------------------------------- reasoning


def _quoted(text: str, start: int, end: int) -> bool:
    """True if text[start:end] touches a quote: ``'``, ``"`` or a lone backtick (a string in
    code or an inline code span, not a tag); a fence's backtick run does not count."""
    before, after = text[start - 1:start], text[end:end + 1]
    if before in ("'", '"') and before or after in ("'", '"') and after:
        return True
    if before == "`" and text[start - 2:start - 1] != "`":
        return True
    return after == "`" and text[end + 1:end + 2] != "`"


def split_reasoning(reply: str) -> tuple[str, list[str]]:
    """Cut the reasoning sections out of ``reply``.

    Returns:
        (the reply without them, the sections' text in order). Tags inside code blocks are
        left alone; see the module docstring for the tags and the rules.
    """
    reply = reply or ""
    reasoning: list[str] = []
    start = 0
    m = _ORPHAN_CLOSE.search(reply)
    if m and not _quoted(reply, m.start(), m.end()):
        opener = _OPEN.search(reply, 0, m.start())
        if opener is None:
            if reply[:m.start()].strip():
                reasoning.append(reply[:m.start()].strip())
            start = m.end()
    out: list[str] = []
    look = _Lookahead(reply)
    lines = _lines(reply, start)
    i = 0
    while i < len(lines):
        # indices into ``reply``, never a slice of the line: after a closing tag the rest of
        # a long line is looked at again, and copying it each time was quadratic
        s, e = lines[i]
        op = _opener(reply, lines, i, look)
        m = _OPEN.search(reply, s, e)
        if op is not None and not (op.pre_end and m is not None and m.start() < op.pre_end):
            j, used = _fence_end(reply, lines, i, op, look=look)
            if not used:
                out.append(reply[s:lines[j][0]])
                i = j
                continue
            last = lines[min(j, len(lines) - 1)]
            out.append(reply[s:last[1]])
            i = j + 1
            continue
        if m is None or _quoted(reply, m.start(), m.end()):
            out.append(reply[s:e])
            i += 1
            continue
        out.append(reply[s:m.start()])
        k = next(n for n, v in m.groupdict().items() if v is not None and n != "tag")
        close_pat = _REASONING_TAGS[int(k[1:])][1]
        if "{tag}" in close_pat:
            close_pat = close_pat.format(tag=re.escape(m.group("tag")))
        body_start = m.end()
        c = re.compile(close_pat, re.IGNORECASE).search(reply, body_start)
        if c is None:
            reasoning.append(reply[body_start:].strip())
            break
        reasoning.append(reply[body_start:c.start()].strip())
        # go on after the closing tag, as if it started a line
        i = _resume_at(lines, i, c.end())
    text = "".join(out)
    if reasoning and _FINAL_CHANNEL.search(text):
        text = _FINAL_CHANNEL.sub("", text)
    return text.strip("\n") if reasoning else text, [r for r in reasoning if r]


def _resume_at(lines: list[tuple[int, int]], i: int, pos: int) -> int:
    """Index of the line holding ``pos`` (from ``lines[i]`` on), that line now starting at
    ``pos``; ``len(lines)`` past the end. In place, so many tags on one long line cost a search
    each, not a new split of the rest of the text (which made them quadratic)."""
    k = bisect.bisect_right(lines, pos, lo=i, key=lambda ln: ln[0]) - 1
    if pos >= lines[k][1]:
        return k + 1  # the tag ends the text
    lines[k] = (pos, lines[k][1])
    return k


def _lines(text: str, start: int) -> list[tuple[int, int]]:
    """(start, end) of each line of ``text`` from ``start`` on, newline included."""
    out, pos = [], start
    while pos < len(text):
        nl = text.find("\n", pos)
        end = len(text) if nl < 0 else nl + 1
        out.append((pos, end))
        pos = end
    return out


# --------------------------------------------------------------------------- fences


@dataclass
class _Opener:
    indent: int
    char: str
    length: int
    lang: str
    pre_start: int = 0  # the prose before an inline opener: text[pre_start:pre_end]
    pre_end: int = 0    # 0: none

    def pre(self, text: str) -> str:
        return text[self.pre_start:self.pre_end]


_NO_FENCE = object()  # the line does not start with a fence (an inline opener may follow)


def _line_end(text: str, s: int, e: int) -> int:
    return e - 1 if e > s and text[e - 1] == "\n" else e


def _opener(text: str, lines: list[tuple[int, int]], i: int,
            look: "_Lookahead | None" = None) -> _Opener | None:
    """The fence opened by ``lines[i]``, or None. Read by index, without copying the line."""
    s, e = lines[i]
    end = _line_end(text, s, e)
    op = _fence_opener(text, s, end)
    if op is _NO_FENCE:
        return _inline_opener(text, s, end, look)
    if op is not None and not op.lang and i + 1 < len(lines):
        # a stray bare fence line right before a code block's opener is not a block
        ns, ne = lines[i + 1]
        nxt = _fence_opener(text, ns, _line_end(text, ns, ne))
        if isinstance(nxt, _Opener) and nxt.lang in CODE_LANGS:
            return None
    return op  # type: ignore[return-value]


def _fence_opener(text: str, s: int, end: int):
    """The CommonMark fence opener ``text[s:end]`` is (indent, a run of 3+ backticks or
    tildes, an info string), None when it is refused (a backtick fence's info string holds a
    backtick), or :data:`_NO_FENCE`."""
    j = s
    while j < end and text[j] in " \t":
        j += 1
    if j >= end or text[j] not in "`~":
        return _NO_FENCE
    ch, k = text[j], j
    while k < end and text[k] == ch:
        k += 1
    if k - j < 3:
        return _NO_FENCE
    if ch == "`" and text.find("`", k, end) >= 0:
        return None  # CommonMark: a backtick fence's info string holds no backtick
    lang = (text[k:end].strip().split() or [""])[0].lower()
    return _Opener(j - s, ch, k - j, lang)


def _inline_opener(text: str, s: int, end: int, look: "_Lookahead | None") -> _Opener | None:
    """An opener after other text on its line ("Here it is: ```repl"): not CommonMark, but
    models write it; only for code languages, only with backticks. Read from the line's end,
    once per line (``look`` keeps it): a regex with two lazy groups here was quadratic."""
    tail = look.tails.get(end) if look is not None else None
    if tail is None:
        tail = _fence_tail(text, s, end)
        if look is not None:
            look.tails[end] = tail
    if not tail:
        return None
    lang, run, length = tail
    if run < s:
        return None
    first = s
    while first < run and text[first].isspace():
        first += 1
    if first >= run:
        return None  # nothing but blanks before the fence
    return _Opener(0, "`", length, lang, s, run)


def _fence_tail(text: str, s: int, end: int) -> tuple:
    """``(lang, where its backtick run starts, the run's length)`` when ``text[s:end]`` ends
    in a run of 3+ backticks and a code language (blanks around it), else ``()``."""
    t = end
    while t > s and text[t - 1] in " \t":
        t -= 1
    k = t
    while k > s and t - k <= 16 and text[k - 1].isascii() and text[k - 1].isalnum():
        k -= 1
    lang = text[k:t].lower()
    if lang not in CODE_LANGS:
        return ()
    r = k
    while r > s and text[r - 1] in " \t":
        r -= 1
    run = r
    while run > s and text[run - 1] == "`":
        run -= 1
    return (lang, run, r - run) if r - run >= 3 else ()


def _is_closer(line: str, char: str, length: int) -> bool:
    s = line.strip()
    return len(s) >= length and s == char * len(s)


class _PyStrings:
    """Tracks whether Python source, fed line by line, is inside a triple-quoted string."""

    _PREFIX = re.compile(r"[rRbBuUfF]{0,2}$")

    def __init__(self) -> None:
        self.open: str | None = None  # '"""' or "'''" while inside one

    def feed(self, line: str) -> None:
        i, n = 0, len(line)
        while i < n:
            if self.open:
                if line[i] == "\\":
                    i += 2
                elif line.startswith(self.open, i):
                    i += 3
                    self.open = None
                else:
                    i += 1
                continue
            ch = line[i]
            if ch == "#":
                return
            if ch in "\"'":
                if line.startswith(ch * 3, i):
                    self.open = ch * 3
                    i += 3
                    continue
                i += 1  # a one-line string: to its closing quote or the end of the line
                while i < n and line[i] != ch and line[i] != "\n":
                    i += 2 if line[i] == "\\" else 1
                i += 1
                continue
            i += 1


class _Lookahead:
    """What one parse may still spend (characters) looking past a closing-fence line held in
    an open string for the block's real end. Each such search can run to the end of the text,
    so a reply of many such blocks would be quadratic; once this is spent, the first closing
    line is taken, as if the string were not there."""

    def __init__(self, text: str) -> None:
        self.left = 2 * len(text) + 65536
        #: line end -> what :func:`_fence_tail` found there (a line's tail is read once)
        self.tails: dict[int, tuple] = {}


def _fence_end(text: str, lines: list[tuple[int, int]], i: int, op: _Opener,
               cut: bool = False, look: _Lookahead | None = None) -> tuple[int, bool]:
    """Where the fence opened at ``lines[i]`` ends: (index of its closing line, or
    ``len(lines)`` if none; whether that line is used up, False when it opens the next block).

    Inside a code block, outside any triple-quoted string, a line that starts with the opener's
    backtick run closes the block even with text after it (such a line is never Python); if
    that text names a code language, the same line opens the next block.
    """
    char, length = op.char, op.length
    strings = _PyStrings() if op.lang in CODE_LANGS else None
    first_closer = None
    for j in range(i + 1, len(lines)):
        line = text[lines[j][0]:lines[j][1]]
        if first_closer is not None and look is not None:
            look.left -= len(line)
            if look.left < 0:
                return first_closer, True
        if _is_closer(line, char, length):
            if strings is None or strings.open is None:
                return j, True
            if first_closer is None:
                first_closer = j
        elif strings is not None and strings.open is None and char == "`" \
                and line.lstrip().startswith("`" * length):
            rest = line.strip().lstrip("`").strip()
            reopen = (rest.split() or [""])[0].lower() in CODE_LANGS
            return j, not reopen
        if strings is not None:
            strings.feed(line)
    if first_closer is not None and not cut:
        return first_closer, True
    return len(lines), True


def parse_reply(reply: str, *, cut: bool = False) -> ParsedReply:
    """Take ``reply`` apart: reasoning sections out, then its fenced blocks and its prose.

    Args:
        cut: the reply stopped at the output-token limit (``finish_reason == "length"``): an
            unclosed block is taken as cut mid-way (no fallback closing line is searched).
    """
    text, reasoning = split_reasoning(reply or "")
    blocks: list[Block] = []
    prose: list[str] = []
    look = _Lookahead(text)
    lines = _lines(text, 0)
    i = 0
    while i < len(lines):
        s, e = lines[i]
        op = _opener(text, lines, i, look)
        if op is None:
            prose.append(text[s:e])
            i += 1
            continue
        if op.pre_end:
            prose.append(op.pre(text) + "\n")
        j, used = _fence_end(text, lines, i, op, cut, look)
        body = [_dedent(text[a:b], op.indent) for a, b in lines[i + 1:j]]
        blocks.append(Block("".join(body).strip("\n"), op.lang, j < len(lines)))
        if j < len(lines) and used:
            rest = text[lines[j][0]:lines[j][1]].strip().lstrip(op.char).strip()
            if rest:
                prose.append(rest + "\n")
        i = j + 1 if used else j
    return ParsedReply(text=text, reasoning=reasoning, blocks=blocks, prose="".join(prose))


def _dedent(line: str, n: int) -> str:
    k = 0
    while k < n and k < len(line) and line[k] in " \t":
        k += 1
    return line[k:]


def code_blocks(reply: str, cut: bool = False) -> list[str]:
    """The code of every ```repl (or ```python) block in ``reply``, in order; reasoning
    sections never count, and with ``cut`` an unclosed last block is left out."""
    return parse_reply(reply, cut=cut).code_blocks(cut)


def prose_final(reply: str) -> bool:
    """True if ``reply`` writes FINAL(...)/FINAL_VAR(...) outside any code block (and outside
    its reasoning)."""
    return parse_reply(reply).prose_final()


def reasoning_from_message(message: dict) -> str:
    """The text of a chat message's separate reasoning fields (:data:`REASONING_FIELDS`),
    joined; ``message`` is the reply's message object as JSON (a dict)."""
    parts: list[str] = []
    for name in REASONING_FIELDS:
        v = message.get(name)
        if isinstance(v, str) and v.strip():
            if v.strip() not in parts:
                parts.append(v.strip())
        elif isinstance(v, list):
            for item in v:
                t = item.get("text") or item.get("summary") if isinstance(item, dict) else None
                if isinstance(t, str) and t.strip() and t.strip() not in parts:
                    parts.append(t.strip())
        elif isinstance(v, dict):
            t = v.get("text") or v.get("content") or v.get("summary")
            if isinstance(t, str) and t.strip() and t.strip() not in parts:
                parts.append(t.strip())
    return "\n\n".join(parts)
