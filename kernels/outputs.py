"""What a cell displayed, as the text the model reads.

A Jupyter output (``execute_result``, ``display_data``, ``update_display_data``) is a *mime
bundle*: one value in several forms (``text/plain``, ``text/markdown``, ``text/html``,
``image/png``, ...), of which a notebook shows the richest it can render. The model reads text,
so :func:`bundle_text` picks the richest *text* form a bundle offers: ``text/markdown``, then
``text/plain`` unless it is only the default ``<... object>`` repr (``display(Markdown(...))``
carries nothing else there), then ``text/html`` reduced to its text (a table's cells kept in
rows), ``text/latex``, JSON; images and other binary forms become a one-line note saying what
was shown and that it is not readable here. A DataFrame's ``text/plain`` is its table.

Streams are rendered as a notebook renders them (:func:`render_stream`): terminal colour codes
dropped, and a carriage return overwriting its line (a progress bar shows its last state, not
every step). :func:`hints` adds one line of advice after the output for the errors of idioms
that cannot work in a kernel, saying what to write instead.

Host side only (it runs on the output the host received), so nothing a cell does changes it.
The result is cut to the output limit by the caller, as every output is.
"""
from __future__ import annotations

import base64
import json
import re
import struct
from html.parser import HTMLParser

__all__ = ["CellOutput", "bundle_text", "hints", "html_text", "render_stream", "strip_ansi",
           "take_message"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
#: IPython's default repr of an object with no repr of its own: says nothing of its content.
_DEFAULT_REPR = re.compile(r"<[\w.]+ (?:object|at 0x[0-9a-f]+)(?: at 0x[0-9a-f]+)?>")
#: Text forms after ``text/plain``, richest first.
_TEXT_FORMS = ("text/html", "text/latex", "application/json", "text/x-python")


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (colours, cursor moves, titles)."""
    return _ANSI.sub("", text) if "\x1b" in text else text


def render_stream(text: str) -> str:
    """A cell's stream output as a notebook shows it: ANSI codes dropped, and on each line the
    text after its last carriage return only (``\\r\\n`` is a line end). Linear in ``text``."""
    text = strip_ansi(text)
    if "\r" not in text:
        return text
    lines = text.replace("\r\n", "\n").split("\n")
    return "\n".join(line[line.rindex("\r") + 1:] if "\r" in line else line for line in lines)


def bundle_text(data: dict) -> str:
    """The text of one mime bundle (``{mime type: value}``) for the model, with a trailing
    newline; ``""`` when it offers nothing at all. See the module docstring for the order."""
    parts = []
    text = _richest_text(data)
    if text:
        parts.append(text.rstrip("\n"))
    notes = [_binary_note(mime, value) for mime, value in data.items()
             if not _is_text_form(mime)]
    parts += [n for n in notes if n]
    return "\n".join(parts) + "\n" if parts else ""


def _richest_text(data: dict) -> str:
    md = data.get("text/markdown")
    if isinstance(md, str) and md.strip():
        return md
    plain = data.get("text/plain")
    if isinstance(plain, str) and plain.strip() and not _DEFAULT_REPR.fullmatch(plain.strip()):
        return strip_ansi(plain)
    for mime in _TEXT_FORMS:
        if mime in data:
            value = data[mime]
            if mime == "text/html":
                value = html_text(str(value))
            elif not isinstance(value, str):
                value = json.dumps(value, ensure_ascii=False)
            if value.strip():
                return value
    # nothing but the default repr (or nothing): what the notebook's text view shows
    return strip_ansi(plain) if isinstance(plain, str) else ""


def _is_text_form(mime: str) -> bool:
    return mime in ("text/plain", "text/markdown") or mime in _TEXT_FORMS


def _binary_note(mime: str, value) -> str:
    """One line for an output the model cannot read (an image, a widget, a script)."""
    if mime.startswith("application/vnd.jupyter.widget"):
        return "[an interactive widget was displayed: it is not readable here]"
    size = len(value) if isinstance(value, str) else len(json.dumps(value, default=str))
    what = ""
    if mime.startswith("image/"):
        dims = _png_size(value) if mime == "image/png" and isinstance(value, str) else None
        what = f"{dims[0]}x{dims[1]} " if dims else ""
        return (f"[{mime} image {what}displayed ({size:,} bytes encoded): images are not "
                "shown to you; print the numbers behind it instead]")
    return f"[{mime} output displayed ({size:,} bytes): not readable here]"


def _png_size(b64: str) -> tuple[int, int] | None:
    """Width and height of a base64 PNG from its header, or None."""
    try:
        head = base64.b64decode(b64[:44] + "=" * (-len(b64[:44]) % 4))
    except (ValueError, TypeError):
        return None
    if head[:8] != b"\x89PNG\r\n\x1a\n" or len(head) < 24:
        return None
    return struct.unpack(">II", head[16:24])


class _HTMLText(HTMLParser):
    """Collects an HTML fragment's text: blocks on their own lines, table cells split by
    ``|``, scripts and styles dropped."""

    _BLOCKS = {"p", "div", "br", "tr", "li", "h1", "h2", "h3", "h4", "h5", "h6", "table",
               "thead", "tbody", "pre", "ul", "ol", "hr", "section", "blockquote"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self._skip = 0
        self._cell = False

    def handle_starttag(self, tag, attrs) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("td", "th"):
            if self._cell:
                self.out.append(" | ")
            self._cell = True
        elif tag in self._BLOCKS:
            self.out.append("\n")
            self._cell = False
            if tag == "li":
                self.out.append("- ")

    def handle_endtag(self, tag) -> None:
        if tag in ("script", "style"):
            self._skip = max(0, self._skip - 1)
        elif tag in self._BLOCKS:
            self.out.append("\n")
            self._cell = False

    def handle_data(self, data) -> None:
        if not self._skip:
            self.out.append(data)


def html_text(html: str) -> str:
    """The text of an HTML fragment (see :class:`_HTMLText`), blank lines squeezed."""
    p = _HTMLText()
    p.feed(html)
    p.close()
    lines = [re.sub(r"[ \t]+", " ", ln).strip() for ln in "".join(p.out).split("\n")]
    return "\n".join(ln for ln in lines if ln)


#: (pattern in the output, advice): errors of idioms that cannot work in a kernel.
HINTS = (
    (re.compile(r"asyncio\.run\(\) cannot be called from a running event loop|"
                r"This event loop is already running|"
                r"Cannot run the event loop while another loop is running"),
     "a cell already runs inside an event loop: write `await main()` at the top level of the "
     "cell, or `asyncio.run(main())`; not `loop.run_until_complete(...)`"),
    (re.compile(r"Can't get attribute '[^']*' on <module '__m(?:p_)?ain__'"),
     "a process started with the spawn or forkserver method cannot see functions defined in a "
     "cell: use multiprocessing.Pool() or ProcessPoolExecutor() with the default start method, "
     "threads (concurrent.futures.ThreadPoolExecutor), or llm_query_batched(prompts)"),
    (re.compile(r"Can't pickle <function <lambda>|Can't pickle local object"),
     "a process pool cannot be sent a lambda or a nested function: define the function with "
     "def at the top level of a cell, or use threads (concurrent.futures.ThreadPoolExecutor)"),
)


def hints(output: str) -> str:
    """Advice lines (``"[hint: ...]"``, each on its own line, with a leading newline) for the
    errors in ``output`` that :data:`HINTS` knows; ``""`` for none."""
    found = [advice for pattern, advice in HINTS if pattern.search(output)]
    return "".join(f"\n[hint: {a}]" for a in found)


class CellOutput:
    """A running cell's output, in order, as the model will read it.

    ``add(text)`` appends; ``clear(wait)`` is Jupyter's ``clear_output``: what came before is
    dropped, at once or (``wait``) when the next output arrives, as a notebook does.
    """

    def __init__(self) -> None:
        self.parts: list[str] = []
        self._clear_next = False

    def add(self, text: str) -> None:
        """Append ``text`` (str; "" adds nothing)."""
        if not text:
            return
        if self._clear_next:
            self.parts.clear()
            self._clear_next = False
        self.parts.append(text)

    def clear(self, wait: bool = False) -> None:
        """Drop the output so far (``wait``: when the next output arrives)."""
        if wait:
            self._clear_next = True
        else:
            self.parts.clear()

    def text(self) -> str:
        """Everything, rendered as :func:`render_stream` does, then :func:`hints` (str)."""
        text = render_stream("".join(self.parts))
        return text + hints(text)

    def tail(self, n: int) -> str:
        """The last ``n`` characters, unrendered (for a message about a dead kernel)."""
        return "".join(self.parts)[-n:]


def take_message(mtype: str, content: dict, out: CellOutput, res) -> bool:
    """Add one IOPub message of the running cell to ``out`` (and its error to ``res.error``,
    ``"Name: value"``); True once the kernel reports the cell done (``status: idle``)."""
    if mtype == "stream":
        out.add(content.get("text", ""))
    elif mtype in ("execute_result", "display_data", "update_display_data"):
        out.add(bundle_text(content.get("data") or {}))
    elif mtype == "clear_output":
        out.clear(bool(content.get("wait")))
    elif mtype == "error":
        tb = "\n".join(content.get("traceback") or [])
        out.add(strip_ansi(tb) + "\n")
        res.error = f"{content.get('ename')}: {content.get('evalue')}"
    elif mtype == "status" and content.get("execution_state") == "idle":
        return True
    return False
