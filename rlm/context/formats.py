"""Reading one file of a context: compressed files, JSON Lines, CSV/TSV, PDF, HTML, and
text in encodings other than UTF-8.

:func:`convert` turns a file's bytes into the value the kernel will hold:

==================  ============================================  ===========
suffix              value                                         ``kind``
==================  ============================================  ===========
``.gz .bz2 .xz``    decompressed, then read by the inner suffix    (inner)
``.jsonl .ndjson``  a list of records (one JSON value per line)    ``records``
``.csv .tsv``       a list of rows, each a dict column -> str      ``rows``
``.pdf``            a list of page texts (needs the ``pdf`` extra)  ``pages``
``.html .htm``      the readable text (no tags, scripts, styles)    ``text``
anything else       the text                                       ``text``
==================  ============================================  ===========

Text is UTF-8 when it decodes as UTF-8; otherwise (unless an encoding was given) the
encoding is detected with ``charset-normalizer`` and the detection is recorded. A file
that is not text raises :class:`Unreadable` with a short ``reason`` the directory loader
lists in the context metadata.
"""
from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any

from harness.text import clean, clean_text

from rlm.errors import ContextError

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

PDF_HINT = "pip install 'rlm-kernels[pdf]'"
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
    """A file's value for the kernel: ``kind`` text/records/rows/pages; ``notes`` say what
    was done that the model should know (detected encoding, decompression, a fallback)."""

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
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(clean(json.loads(line)))  # "\ud83d" escapes: see harness.text
        except json.JSONDecodeError as exc:
            raise ContextError(f"context {source} is not valid JSON Lines (line {i}, column "
                               f"{exc.colno}: {exc.msg})") from None
    return out


def parse_csv(text: str, delimiter: str) -> list[dict]:
    import csv
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter, restkey="_extra",
                            restval="")
    return [dict(row) for row in reader]


def convert(name: str, data: bytes, source: str, encoding: str | None,
            limit: int | None = None, lenient: bool = False) -> Converted:
    """Turn one file's bytes into its context value (see the module docstring).

    Args:
        name: the file name (its suffixes choose the format).
        lenient: a file that fails to parse as JSON Lines/CSV is kept as text with a note
            (directories) instead of raising (a single-file context).
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
    if suf == ".pdf":
        return Converted(pdf_pages(data, source), "pages", None, notes)
    text, detected = decode(data, source, encoding)
    if detected:
        notes.append(f"decoded as {detected} (detected)")
    try:
        if suf in (".jsonl", ".ndjson"):
            return Converted(parse_jsonl(text, source), "records", detected, notes)
        if suf in (".csv", ".tsv"):
            return Converted(parse_csv(text, "\t" if suf == ".tsv" else ","), "rows", detected, notes)
    except ContextError as exc:
        if not lenient:
            raise
        notes.append(f"kept as text: {str(exc).split('(', 1)[-1].rstrip(')')}")
        return Converted(text, "text", detected, notes)
    if suf in (".html", ".htm", ".xhtml"):
        return Converted(html_to_text(text), "text", detected, notes + ["HTML shown as text"])
    return Converted(text, "text", detected, notes)
