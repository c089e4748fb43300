"""Taking secrets out of text: the one redaction, applied where provider text enters the host.

An upstream may quote what it was sent (some proxies echo the ``Authorization`` header, or the
key, in an error's text), and that text goes everywhere: the journal (a model call's attempts),
exports, views, spans, log lines, kernels, serve responses. :class:`Redactor` takes out

* each secret it is given, as it is and in base64 (standard and URL-safe, at any of the three
  byte alignments, so base64 of ``"user:KEY"`` or of ``"Bearer KEY"`` is caught too), and
* in :meth:`Redactor.text`, anything shaped like a credential (:data:`KEYLIKE`): ``sk-...``
  keys, ``Bearer ...`` tokens.

Pure and standard library only: the host's model clients (:mod:`rlm.models.transport`) and
``rlm serve`` (:mod:`rlm.serve.errors`) both build theirs from it; which values are secrets is
theirs to say.
"""
from __future__ import annotations

import base64
import re
from typing import Any, Iterable

__all__ = ["KEYLIKE", "MIN_SECRET", "REDACTED", "Redactor"]

#: What a secret becomes.
REDACTED = "[redacted]"
#: What looks like a credential in any text: an OpenAI/Anthropic-style key (``sk-...``,
#: ``sk-ant-...``) or a bearer token.
KEYLIKE = re.compile(r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_\-]{3,}"
                     r"|\b(?i:bearer)\s+[^\s\"',;]+")
#: Shorter values are no secret worth the name (and would blank out common words).
MIN_SECRET = 6
#: Placeholders that stand for "no key" (local servers), never redacted.
_NOT_SECRETS = frozenset({"EMPTY", "none", "None", "null", "dummy"})


def _base64_cores(secret: bytes) -> set[str]:
    """The parts of base64 text that encode ``secret`` whatever comes before and after it:
    for each of the 3 byte alignments, the characters that hold only the secret's bits."""
    out: set[str] = set()
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + secret + b"\0\0").decode()
        start, end = (8 * k + 5) // 6, (8 * (k + len(secret))) // 6
        core = enc[start:end]
        if len(core) >= MIN_SECRET:
            out.update({core, core.replace("+", "-").replace("/", "_")})
    return out


class Redactor:
    """Replaces secrets in text with ``[redacted]``.

    Args:
        secrets: the values to take out (str; ones shorter than :data:`MIN_SECRET` characters,
            and placeholders such as ``EMPTY``, are ignored).

    Attributes:
        needles: every string searched for, longest first (the secrets and their base64).
    """

    def __init__(self, secrets: Iterable[Any] = ()) -> None:
        found = {s.strip() for s in secrets if isinstance(s, str)}
        found = {s for s in found if len(s) >= MIN_SECRET and s not in _NOT_SECRETS}
        needles = set(found)
        for s in found:
            needles |= _base64_cores(s.encode("utf-8", "surrogatepass"))
        self.secrets = sorted(found, key=len, reverse=True)
        self.needles = sorted(needles, key=len, reverse=True)

    def secrets_out(self, text: str) -> str:
        """``text`` with every secret (and its base64) replaced; shapes are left alone (a
        model's reply may rightly hold ``sk-...`` text). Returns ``text`` itself when clean."""
        for n in self.needles:
            if n in text:
                text = text.replace(n, REDACTED)
        return text

    def text(self, text: str) -> str:
        """``text`` with every secret, its base64, and every credential shape
        (:data:`KEYLIKE`) replaced: for error text, which is never the model's own words."""
        return KEYLIKE.sub(REDACTED, self.secrets_out(text))

    def value(self, obj: Any, shapes: bool = False) -> Any:
        """``obj`` (JSON-like: dicts, lists, str) with :meth:`secrets_out` (or :meth:`text`
        when ``shapes``) applied to every string in it, keys included; the same object when
        nothing changed, else a copy."""
        fix = self.text if shapes else self.secrets_out
        if isinstance(obj, str):
            return fix(obj)
        if isinstance(obj, dict):
            changed, new = False, {}
            for k, v in obj.items():
                k2 = fix(k) if isinstance(k, str) else k
                v2 = self.value(v, shapes)
                changed = changed or k2 is not k or v2 is not v
                new[k2] = v2
            return new if changed else obj
        if isinstance(obj, list):
            new_list = [self.value(v, shapes) for v in obj]
            return obj if all(a is b for a, b in zip(obj, new_list)) else new_list
        return obj

    def exception(self, exc: BaseException) -> BaseException:
        """Take secrets (and credential shapes) out of ``exc`` in place: its ``args``, and
        the ``message`` and ``body`` an SDK error carries (what ``str(exc)`` and the error's
        readers use). Returns ``exc``."""
        exc.args = tuple(self.text(a) if isinstance(a, str) else a for a in exc.args)
        for name in ("message", "body"):
            if hasattr(exc, name):
                try:
                    setattr(exc, name, self.value(getattr(exc, name), shapes=True))
                except (AttributeError, TypeError):
                    pass  # a read-only attribute: args above still hold the text
        return exc
