"""Reading one file of a context: the format table, compressed files, and text in encodings
other than UTF-8.

:data:`FORMATS` is the one table of context formats: each :class:`Format` names its
suffixes, the kind of value it becomes, its description (the one text that tells the user
and the model what such a value is) and its converter. Everything that dispatches on a
suffix or describes a kind reads it: :func:`convert` (one file's bytes -> its value), the
single-file loader (:mod:`rlm.context.load`), the many-file loader (which files are read in
place: :mod:`rlm.context.sources`) and the listing (:mod:`rlm.context.listing`).
:func:`overview` renders the table for help texts.

**Adding a format** is one converter function ``(text, source, suffix) -> value`` (``bytes``
instead of ``text`` for a ``binary`` format; raise :class:`~rlm.errors.ContextError` naming
``source`` when the file is malformed) and one :class:`Format` entry in :data:`FORMATS`.

Around the table: ``.gz``/``.bz2``/``.xz`` files are decompressed, then read by their inner
suffix (:data:`COMPRESSED`); images, media, archives and compiled files are refused unread
(:data:`BINARY_SUFFIXES`); a file of any other suffix is text (:data:`TEXT`).

Text is UTF-8 when it decodes as UTF-8; otherwise (unless an encoding was given) the
encoding is detected with ``charset-normalizer`` and the detection is recorded. A file
that is not text raises :class:`Unreadable` with a short ``reason`` the directory loader
lists in the context metadata.
"""
from __future__ import annotations

import bz2
import datetime
import gzip
import io
import json
import lzma
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any, Callable

from harness.text import clean, clean_text

from rlm.errors import ContextError, install_hint

#: Compression suffix -> opener of a file object: read through, then by the inner suffix.
COMPRESSED = {".gz": lambda f: gzip.GzipFile(fileobj=f), ".bz2": bz2.BZ2File, ".xz": lzma.LZMAFile}

#: Suffixes skipped without reading: images, media, archives, compiled and office files.
BINARY_SUFFIXES = frozenset("""
.png .jpg .jpeg .gif .bmp .ico .webp .tif .tiff .psd .svgz .heic
.mp3 .mp4 .wav .flac .ogg .m4a .avi .mov .mkv .webm
.zip .tar .tgz .tbz2 .txz .7z .rar .whl .jar .war .egg .deb .rpm .dmg .iso .zst .lz4
.pyc .pyo .so .dylib .dll .exe .o .a .lib .class .bin .dat .db .sqlite .sqlite3 .pkl .pickle
.npy .npz .parquet .feather .arrow .h5 .hdf5 .onnx .pt .pth .safetensors .gguf
.doc .docx .xls .xlsx .ppt .pptx .odt .ods .odp .woff .woff2 .ttf .otf .eot
""".split())
ARCHIVES = frozenset(".zip .tar .tgz .tbz2 .txz .7z .rar .whl .jar .war .egg .deb .rpm .zst .lz4".split())

PDF_HINT = install_hint("pdf")
_CHUNK = 1 << 20


class Unreadable(ContextError):
    """A file that is not text the harness reads; ``reason`` is a few words for the metadata."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class TooBig(ContextError):
    """Decompressed data grew past the byte cap."""


@dataclass
class Converted:
    """A file's value for the kernel: ``kind`` its format's (:attr:`Format.kind`: text,
    records, rows, pages, toml, ...); ``notes`` say what was done that the model should know
    (detected encoding, decompression, a fallback)."""

    value: Any
    kind: str
    encoding: str | None = None
    notes: list = field(default_factory=list)


def split_suffixes(name: str) -> tuple[str, str | None]:
    """``("log.jsonl", ".gz")`` for ``log.jsonl.gz``: the inner suffix and the compression."""
    low = name.lower()
    for suf in COMPRESSED:
        if low.endswith(suf):
            return low[: -len(suf)], suf
    return low, None


def suffix(name: str) -> str:
    """The last suffix of ``name``, lower case (``".gz"`` for ``A.Log.GZ``; ``""`` for none)."""
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 and "/" not in name[dot:] else ""


def decompress(data: bytes, comp: str, source: str, limit: int | None) -> bytes:
    """Decompress ``data`` (``.gz``/``.bz2``/``.xz``), refusing to grow past ``limit`` bytes."""
    out = bytearray()
    try:
        with COMPRESSED[comp](io.BytesIO(data)) as f:
            while True:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                out += chunk
                if limit is not None and len(out) > limit:
                    raise TooBig(f"{source} decompresses to more than {limit:,} bytes")
    except (OSError, EOFError, lzma.LZMAError, ValueError) as exc:
        raise Unreadable(f"{source} is not a valid {comp} file ({exc})", f"corrupt {comp}") from None
    return bytes(out)


def looks_binary(data: bytes) -> bool:
    return b"\x00" in data[:65536]


def _bom_encoding(data: bytes) -> str | None:
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "utf-32"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "utf-16"
    return None


def is_utf8(encoding: str | None) -> bool:
    """True if ``encoding`` (an ``encoding=`` option) means UTF-8 or detection (None, ``""``,
    ``"auto"``, ``"utf-8"``, ``"UTF8"``, ``"utf_8"``)."""
    return encoding is None or encoding.lower().replace("-", "").replace("_", "") in (
        "utf8", "auto", "")


def decode(data: bytes, source: str, encoding: str | None) -> tuple[str, str | None]:
    """Decode text; returns ``(text, detected)`` where ``detected`` names an encoding found by
    detection (None when the text is UTF-8 or ``encoding`` was given). A UTF-8 BOM is dropped;
    lone surrogates (some codecs, such as utf-7, decode to them) become U+FFFD
    (:mod:`harness.text`).

    Raises:
        Unreadable: binary data, or bytes no encoding explains.
        ContextError: an unknown ``encoding``, or bytes that do not decode with the given one.
    """
    text, detected = _decode_raw(data, source, encoding)
    if detected is None and is_utf8(encoding):
        return text, None  # strict UTF-8 never decodes to a surrogate: no second scan
    return clean_text(text), detected


def _decode_raw(data: bytes, source: str, encoding: str | None) -> tuple[str, str | None]:
    """:func:`decode` before the text policy (same errors)."""
    enc = None if encoding in (None, "", "auto") else encoding
    bom = _bom_encoding(data) if enc is None else None
    if bom:
        return data.decode(bom, errors="strict"), bom
    if looks_binary(data):
        raise Unreadable(f"context {source} looks binary (it contains NUL bytes); give a text "
                         "file, or convert it to text first", "binary")
    if enc is not None:
        try:
            text = data.decode(enc)
        except UnicodeDecodeError as exc:
            raise ContextError(
                f"context {source} is not valid {enc} (byte {exc.start}: "
                f"{data[exc.start:exc.start + 4]!r}); re-run with --encoding latin-1 (or the file's "
                "real encoding), or leave --encoding out to detect it") from None
        except LookupError:
            raise ContextError(f"unknown encoding {enc!r}") from None
        return (text[1:] if text.startswith("\ufeff") else text), None
    try:
        text = data.decode("utf-8")
        return (text[1:] if text.startswith("\ufeff") else text), None
    except UnicodeDecodeError as exc:
        first_bad = exc.start
    best = _detect(data)
    if best is None or best.encoding in ("utf_8", "utf-8"):
        raise Unreadable(
            f"context {source} is not valid UTF-8 (byte {first_bad}: "
            f"{data[first_bad:first_bad + 4]!r}) and its encoding could not be detected; "
            "re-run with --encoding latin-1 (or the file's real encoding)", "undecodable")
    text = data.decode(best.encoding, errors="strict")
    if "\x00" in text:
        raise Unreadable(f"context {source} is not valid UTF-8 (byte {first_bad}) and contains "
                         "NUL bytes: it looks binary, not text", "binary")
    return text, best.encoding


#: On a tie (same chaos and coherence: e.g. French text fits cp1250 as well as cp1252) the
#: commonest legacy encodings win, not the first one charset-normalizer lists.
_PREFERRED = ("cp1252", "iso8859_15", "latin_1", "cp1251", "koi8_r", "shift_jis", "gb18030",
              "big5", "euc_kr", "euc_jp")


def _detect(data: bytes):
    from charset_normalizer import from_bytes
    results = list(from_bytes(data))
    if not results:
        return None
    best = results[0]
    ties = {r.encoding: r for r in results
            if r.chaos == best.chaos and r.coherence == best.coherence}
    return next((ties[e] for e in _PREFERRED if e in ties), best)


class _Text(HTMLParser):
    """Readable text of an HTML page: no tags, scripts or styles; blocks on their own lines."""

    BLOCK = frozenset("p div br li ul ol h1 h2 h3 h4 h5 h6 tr table section article header "
                      "footer nav aside pre blockquote dt dd hr title figcaption main form".split())
    HIDDEN = frozenset("script style noscript template svg head".split())

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.HIDDEN and tag != "head":
            self.hidden += 1
        elif tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.HIDDEN and tag != "head":
            self.hidden = max(0, self.hidden - 1)
        elif tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if self.hidden:
            return
        if self.pre:
            self.parts.append(data)
            return
        words = " ".join(data.split())
        lead = " " if data[:1].isspace() and not (self.parts and self.parts[-1][-1:].isspace()) else ""
        self.parts.append(lead + words + (" " if words and data[-1:].isspace() else ""))


def html_to_text(html: str) -> str:
    p = _Text()
    p.feed(html)
    p.close()
    lines = [ln.strip() for ln in "".join(p.parts).splitlines()]
    out, blank = [], False
    for ln in lines:
        if ln:
            out.append(ln)
            blank = False
        elif not blank and out:
            out.append("")
            blank = True
    return "\n".join(out).strip()


def pdf_pages(data: bytes, source: str) -> list[str]:
    """The text of each page of a PDF (pypdf, the ``pdf`` extra)."""
    try:
        from pypdf import PdfReader
    except ImportError:
        raise Unreadable(f"context {source} is a PDF and PDF support is not installed: "
                         f"{PDF_HINT}", "PDF (support not installed: " + PDF_HINT + ")") from None
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise Unreadable(f"context {source} is an encrypted PDF", "encrypted PDF")
        pages = [clean_text(pg.extract_text() or "") for pg in reader.pages]
    except Unreadable:
        raise
    except Exception as exc:  # pypdf raises many types on damaged files
        raise Unreadable(f"context {source} is not a readable PDF ({type(exc).__name__}: {exc})",
                         "damaged PDF") from None
    if not any(p.strip() for p in pages):
        raise Unreadable(f"context {source} is a PDF without a text layer (scanned pages?); "
                         "run OCR on it first", "PDF without text layer")
    return pages


def parse_jsonl(text: str, source: str) -> list:
    """The records of a JSON Lines text: one JSON value per non-blank line, cleaned
    (:mod:`harness.text`).

    Raises:
        ContextError: a line that is not JSON, naming its line and column.
    """
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(clean(json.loads(line)))  # "\ud83d" escapes: see harness.text
        except json.JSONDecodeError as exc:
            raise ContextError(f"context {source} is not valid JSON Lines (line {i}, column "
                               f"{exc.colno}: {exc.msg})") from None
        except (RecursionError, ValueError) as exc:
            raise unparsable(source, f"JSON Lines (line {i})", exc) from None
    return out


def unparsable(source: str, what: str, exc: BaseException) -> ContextError:
    """The error for a file its format's parser gave up on for a reason of its own, not a
    syntax error it locates: nesting past the recursion limit, an integer of more digits than
    Python converts, a CSV field past the ``csv`` module's 131,072-character limit. Says what
    to do: read the file as text (rename it to ``.txt``), or fix it."""
    if isinstance(exc, RecursionError):
        why = "it is nested too deeply"
    else:
        why = " ".join(str(exc).split(";")[0].split()) or type(exc).__name__
    err = ContextError(f"context {source} could not be read as {what} ({why}); rename it to "
                       ".txt to give it as text, or fix the file")
    err.note = why  # type: ignore[attr-defined] - what a directory's listing says of it
    return err


def parse_csv(text: str, delimiter: str) -> list[dict]:
    """The rows of a CSV/TSV text as dicts column -> str (cells past the header's columns
    under ``"_extra"``, missing cells ``""``)."""
    import csv
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter, restkey="_extra",
                            restval="")
    return [dict(row) for row in reader]


_JSON_SCALARS = {type(None): "null", bool: "boolean", int: "number", float: "number"}


def parse_json(text: str, source: str) -> Any:
    """The JSON value of ``text``: a str, list or dict, as parsed (lone surrogates from
    ``"\\ud83d"`` escapes are kept: the caller applies :func:`harness.text.clean`).

    Raises:
        ContextError: not valid JSON (naming the line and column), or a JSON null, boolean
            or number (a context is a string, a list or an object).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ContextError(f"context {source} is not valid JSON (line {exc.lineno}, "
                           f"column {exc.colno}: {exc.msg})") from None
    except (RecursionError, ValueError) as exc:  # nesting or an integer past Python's limits
        raise unparsable(source, "JSON", exc) from None
    if not isinstance(value, (str, list, dict)):
        kind = _JSON_SCALARS.get(type(value), type(value).__name__)
        raise ContextError(f"context {source} holds a JSON {kind}; a JSON context must be a "
                           "string, a list or an object")
    return value


#: Where a TOML error is, as Python 3.11-3.13's ``tomllib`` puts it at the end of its message.
_TOML_AT = re.compile(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)$")


def parse_toml(text: str, source: str) -> dict:
    """The TOML document in ``text`` as a dict: tables are dicts, arrays lists, and dates and
    times ISO 8601 strings (``"1979-05-27T07:32:00+00:00"``), so the value is JSON-like.
    Read with :mod:`tomllib` (Python 3.11+) or its package ``tomli`` (3.10).

    Raises:
        ContextError: not valid TOML, naming ``source`` and the line and column TOML reports.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
        import tomli as tomllib
    try:
        return _json_like(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise ContextError(f"context {source} is not valid TOML ({_toml_where(exc)})") from None
    except RecursionError:
        raise ContextError(f"context {source} is nested too deeply to read as TOML") from None


def _toml_where(exc: ValueError) -> str:
    """``"line 2, column 5: Invalid value"`` for a TOML error: from its ``lineno``/``colno``/
    ``msg`` (tomli 2.1+, Python 3.14+), else from its message."""
    text = str(exc)
    at = _TOML_AT.search(text)
    msg = getattr(exc, "msg", None) or (text[:at.start()] if at else text)
    line, col = getattr(exc, "lineno", None), getattr(exc, "colno", None)
    if line is None and at and at.group(1):
        line, col = int(at.group(1)), int(at.group(2))
    return f"line {line}, column {col}: {msg}" if line is not None else f"at the end: {msg}"


def _json_like(value: Any) -> Any:
    """A parsed TOML value with its dates and times as ISO 8601 strings (JSON has neither)."""
    if isinstance(value, dict):
        return {k: _json_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_like(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):  # a datetime is a date too
        return value.isoformat()
    return value


@dataclass(frozen=True)
class Format:
    """One context format: an entry of :data:`FORMATS`.

    Attributes:
        kind: the kind of value it becomes, as the metadata names it (``"records"``); unique
            in the table, except ``"text"``, which every format read as text shares (HTML).
        suffixes: its file suffixes, lower case, with the dot (``(".jsonl", ".ndjson")``).
        name: the format's name as users know it (``"JSON Lines"``).
        value: what ``context`` (or a key's value) holds for such a file: the one
            description of the kind, shown to the user and the model. ``{name}`` marks where
            the name goes in a sentence (``"a list of {name} records"``); see
            :attr:`description` and :attr:`phrase`.
        convert: ``(text, source, suffix) -> value``: ``text`` the decoded text (the raw
            ``bytes`` for a ``binary`` format), ``source`` the file as messages name it,
            ``suffix`` the one that chose this format. Raises ContextError for a malformed
            file (a directory keeps it as text), :class:`Unreadable` for one not read at all.
        binary: the converter reads bytes (not decoded; no NUL-byte check): PDF.
        directory: converted inside a many-file context too; False keeps such a file as its
            text there (read in place): ``.json``.
    """

    kind: str
    suffixes: tuple[str, ...]
    name: str
    value: str
    convert: Callable[[Any, str, str], Any] = field(repr=False, compare=False)
    binary: bool = False
    directory: bool = True

    @property
    def description(self) -> str:
        """The description as a listing shows it: ``"a list of records (JSON Lines)"``."""
        if "{name}" not in self.value:
            return self.value
        return " ".join(self.value.replace("{name}", "").split()) + f" ({self.name})"

    @property
    def phrase(self) -> str:
        """The description in a sentence: ``"a list of JSON Lines records"``."""
        return self.value.replace("{name}", self.name)


#: Any file no entry of :data:`FORMATS` claims: its text.
TEXT = Format("text", (), "text", "text", lambda text, source, suf: text)

#: The context formats, one entry each (see the module docstring to add one).
FORMATS: tuple[Format, ...] = (
    Format("json", (".json",), "JSON", "JSON data (list or dict)",
           lambda text, source, suf: clean(parse_json(text, source)), directory=False),
    Format("records", (".jsonl", ".ndjson"), "JSON Lines", "a list of {name} records",
           lambda text, source, suf: parse_jsonl(text, source)),
    Format("rows", (".csv", ".tsv"), "CSV/TSV", "a list of {name} row dicts, column -> str",
           lambda text, source, suf: parse_csv(text, "\t" if suf == ".tsv" else ",")),
    Format("toml", (".toml",), "TOML", "a dict of {name} keys and values",
           lambda text, source, suf: parse_toml(text, source)),
    Format("pages", (".pdf",), "PDF", "a list of {name} page texts",
           lambda data, source, suf: pdf_pages(data, source), binary=True),
    Format("text", (".html", ".htm", ".xhtml"), "HTML",
           "the readable text of the page (no tags, scripts or styles)",
           lambda text, source, suf: html_to_text(text)),
)

#: Kinds of values given as Python values rather than read from a file (a mapping's values).
VALUE_KINDS = {"list": "a list", "dict": "a dict"}


def _index(table: tuple[Format, ...]) -> tuple[dict[str, Format], dict[str, Format]]:
    """``(suffix -> format, kind -> format)`` for ``table``.

    Raises:
        ValueError: a suffix claimed twice (or by compression or the binary list), not lower
            case with its dot, or a kind other than ``"text"`` used twice.
    """
    by_suffix: dict[str, Format] = {}
    by_kind: dict[str, Format] = {"text": TEXT}
    for fmt in table:
        for suf in fmt.suffixes:
            if (suf in by_suffix or suf in COMPRESSED or suf in BINARY_SUFFIXES
                    or suf != suf.lower() or not suf.startswith(".")):
                raise ValueError(f"FORMATS: the suffix {suf!r} of {fmt.name} is taken or malformed")
            by_suffix[suf] = fmt
        if fmt.kind != "text":
            if fmt.kind in by_kind or fmt.kind in VALUE_KINDS:
                raise ValueError(f"FORMATS: the kind {fmt.kind!r} of {fmt.name} is taken")
            by_kind[fmt.kind] = fmt
    return by_suffix, by_kind


_BY_SUFFIX, _BY_KIND = _index(FORMATS)


def format_of(name: str, *, directory: bool = False) -> Format:
    """The format a file named ``name`` is read as (its suffix's entry of :data:`FORMATS`,
    else :data:`TEXT`); ``name`` without a compression suffix (:func:`split_suffixes`).
    ``directory``: the file is one of a many-file context (see :attr:`Format.directory`)."""
    fmt = _BY_SUFFIX.get(suffix(name), TEXT)
    return TEXT if directory and not fmt.directory else fmt


def describe_kind(kind: str, *, phrase: bool = False) -> str:
    """The description of a value's ``kind`` (a format's, or a Python value's: ``"list"``):
    as a listing shows it, or (``phrase``) as a sentence does (:class:`Format`)."""
    fmt = _BY_KIND.get(kind)
    if fmt is not None:
        return fmt.phrase if phrase else fmt.description
    return VALUE_KINDS.get(kind, kind)


#: The JSON format: the single-file loader reads it itself (:mod:`rlm.context.load`: a
#: JSON file is read in place when it can be).
JSON = _BY_KIND["json"]


def overview() -> list[tuple[str, str]]:
    """The formats as ``(suffixes, description)`` rows, for help texts and documentation:
    every entry of :data:`FORMATS`, then compressed files, then everything else."""
    rows = [(" ".join(f.suffixes), f.description) for f in FORMATS]
    rows.append((" ".join(COMPRESSED), "decompressed, then read by the inner suffix"))
    rows.append(("anything else", TEXT.description))
    return rows


def convert(name: str, data: bytes, source: str, encoding: str | None,
            limit: int | None = None, lenient: bool = False,
            fmt: Format | None = None) -> Converted:
    """Turn one file's bytes into its context value, by its format (:data:`FORMATS`).

    Args:
        name: the file name (its suffixes choose the format: :func:`format_of`).
        source: the file as messages name it.
        encoding: its text encoding; None or ``"auto"``: UTF-8, else detected.
        limit: the most bytes a compressed file may decompress to (None: no limit).
        lenient: the file is one of a many-file context: a format not converted there
            (``.json``) is read as text, and a file that fails to parse (JSON Lines, CSV,
            TOML) is kept as text with a note instead of raising (a single-file context).
        fmt: the format to read it as, instead of the one its suffix chooses.
    Raises:
        Unreadable: not text the harness reads (binary, a damaged compressed file or PDF).
        TooBig: it decompresses to more than ``limit`` bytes.
        ContextError: an encoding that does not fit, or (not ``lenient``) a malformed file.
    """
    inner, comp = split_suffixes(name)
    notes = []
    if comp:
        data = decompress(data, comp, source, limit)
        notes.append(f"decompressed from {comp}")
    suf = suffix(inner)
    if suf in BINARY_SUFFIXES:
        what = "archive, not read" if suf in ARCHIVES else "binary"
        raise Unreadable(f"context {source} is a {suf} file ({what}); give text files",
                         f"{what} ({suf})")
    fmt = fmt or format_of(inner, directory=lenient)
    if fmt.binary:
        return Converted(fmt.convert(data, source, suf), fmt.kind, None, notes)
    text, detected = decode(data, source, encoding)
    if detected:
        notes.append(f"decoded as {detected} (detected)")
    return _convert_text(fmt, text, source, suf, detected, notes, lenient)


def _convert_text(fmt: Format, text: str, source: str, suf: str, detected: str | None,
                  notes: list, lenient: bool) -> Converted:
    """:func:`convert` once the file is text."""
    if fmt is TEXT:
        return Converted(text, "text", detected, notes)
    try:
        try:
            value = fmt.convert(text, source, suf)
        except (Unreadable, ContextError):
            raise
        except Exception as exc:  # noqa: BLE001 - the parser's own limit on untrusted bytes
            raise unparsable(source, fmt.name, exc) from None
    except Unreadable:
        raise
    except ContextError as exc:
        if not lenient:
            raise
        why = getattr(exc, "note", None) or str(exc).split('(', 1)[-1].rstrip(')')
        notes.append(f"kept as text: {why}")
        return Converted(text, "text", detected, notes)
    if fmt.kind == "text":
        notes = notes + [f"{fmt.name} shown as text"]
    return Converted(value, fmt.kind, detected, notes)
