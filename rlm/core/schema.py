"""Checked structured answers: a JSON Schema and/or a ``verify`` gate the FINAL value must pass.

A run given ``answer_schema=`` (a JSON Schema ``dict``, a JSON file path, a dataclass or a
pydantic model class) and/or ``verify=`` (a callable) does not complete on the first value its
code hands to ``FINAL``/``FINAL_VAR``: the host checks the value first (:class:`AnswerCheck`).
A value that fails is not accepted; the model is told why (the ``jsonschema`` error, or the
gate's reason) and the loop goes on, bounded by its iterations. Each verdict is evidence on
the ``cell`` stage that called ``FINAL`` (``evidence["check"]``).

The value is read back from the answer text the kernel reports: JSON first, then a Python
literal (``FINAL({"a": 1})`` arrives as its ``repr``), else the text itself. An accepted value
becomes the run's answer as canonical JSON text; :func:`load_answer` turns it back into the
dataclass or pydantic object asked for.

``jsonschema`` is a core dependency: checking is always available.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlm.errors import ConfigError

__all__ = ["AnswerCheck", "Verdict", "to_json_schema", "decode_answer", "load_answer",
           "normalize_options"]


# --------------------------------------------------------------------------- schemas

_SIMPLE = {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"},
           bool: {"type": "boolean"}, type(None): {"type": "null"}, dict: {"type": "object"},
           list: {"type": "array"}, Any: {}}


def _type_schema(tp: Any) -> dict:
    if tp in _SIMPLE:
        return dict(_SIMPLE[tp])
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_schema(tp)
    if hasattr(tp, "model_json_schema"):
        return tp.model_json_schema()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type_schema(a) for a in args]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, set, frozenset):
        s: dict = {"type": "array"}
        if args and args[-1] is not Ellipsis:
            s["items"] = _type_schema(args[0])
        return s
    if origin is dict:
        s = {"type": "object"}
        if len(args) == 2:
            s["additionalProperties"] = _type_schema(args[1])
        return s
    raise ConfigError(f"answer_schema: cannot turn the type {tp!r} into a JSON Schema; "
                      "pass a JSON Schema dict instead")


def _dataclass_schema(cls: type) -> dict:
    hints = typing.get_type_hints(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):
        props[f.name] = _type_schema(hints.get(f.name, Any))
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    return {"type": "object", "title": cls.__name__, "properties": props,
            "required": required, "additionalProperties": False}


def to_json_schema(spec: Any) -> dict | None:
    """The JSON Schema (dict) for ``spec``, or None for no schema.

    Args:
        spec: None; a JSON Schema dict; a path (str/``Path``) of a JSON file holding one; a
            dataclass type; a pydantic model class (anything with ``model_json_schema``).
    Raises:
        ConfigError: an unreadable file, or not a valid JSON Schema.
    """
    if spec is None:
        return None
    if isinstance(spec, (str, Path)):
        try:
            spec = json.loads(Path(spec).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--answer-schema {spec}: not a readable JSON file ({exc})") from None
    elif isinstance(spec, type) and (dataclasses.is_dataclass(spec)
                                     or hasattr(spec, "model_json_schema")):
        spec = _type_schema(spec)
    if not isinstance(spec, dict):
        raise ConfigError("answer_schema must be a JSON Schema dict, a JSON file path, a "
                          f"dataclass or a pydantic model class, got {type(spec).__name__}")
    from jsonschema import validators
    from jsonschema.exceptions import SchemaError
    try:
        validators.validator_for(spec).check_schema(spec)
    except SchemaError as exc:
        raise ConfigError(f"answer_schema is not a valid JSON Schema: {exc.message}") from None
    return spec


def normalize_options(o: dict) -> dict:
    """Keyword options with ``answer_schema`` resolved to a JSON Schema dict (journal-safe),
    and ``verify`` checked to be callable. Returns a new dict.

    Raises:
        ConfigError: a bad schema or a ``verify`` that is not callable.
    """
    out = dict(o)
    if out.get("answer_schema") is not None:
        out["answer_schema"] = to_json_schema(out["answer_schema"])
    if out.get("verify") is not None and not callable(out["verify"]):
        raise ConfigError("verify must be a callable taking the answer value")
    return out


# --------------------------------------------------------------------------- values

def decode_answer(text: str) -> Any:
    """The value behind an answer text: JSON, else a Python literal, else the text (str)."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def load_answer(answer: str | None, spec: Any = None) -> Any:
    """An accepted answer (canonical JSON text) as a value: a dataclass instance or pydantic
    model when ``spec`` is one, else the decoded JSON value. None stays None."""
    if answer is None:
        return None
    value = decode_answer(answer)
    if isinstance(spec, type) and dataclasses.is_dataclass(spec) and isinstance(value, dict):
        return spec(**value)
    if isinstance(spec, type) and hasattr(spec, "model_validate"):
        return spec.model_validate(value)
    return value


def _jsonable(value: Any) -> Any:
    """``value`` with tuples as lists and sets left alone (then JSON fails, and says so)."""
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- the gate

@dataclass
class Verdict:
    """One check of a FINAL value.

    Attributes:
        ok: accepted (bool). answer: the accepted answer text (canonical JSON under a schema).
        reason: why it was refused (str, empty when ok). value: the decoded value.
        gate: which check decided (``"schema"``, ``"verify"``, or ``""`` when all passed).
    """

    ok: bool
    answer: str | None = None
    reason: str = ""
    value: Any = None
    gate: str = ""

    def evidence(self) -> dict:
        """What the cell stage keeps as evidence of this verdict (JSON-able): ``ok``, ``gate``,
        ``reason`` and, when accepted, the ``answer`` the run returns (so a journal shows which
        cell produced the run's answer)."""
        ev = {"ok": self.ok, "gate": self.gate, "reason": self.reason}
        if self.ok and self.answer is not None:
            ev["answer"] = self.answer
        return ev

    def feedback(self) -> str:
        """What the model is told when the value was refused."""
        what = "does not match the answer schema" if self.gate == "schema" else \
            "was refused by the answer check"
        return (f"FINAL was NOT accepted: the value {what}: {self.reason}\n"
                "Fix the value and call FINAL again from code.")


class AnswerCheck:
    """The acceptance test of one loop's FINAL value: a JSON Schema, a gate, or both.

    Args:
        schema: a JSON Schema dict (see :func:`to_json_schema`) or None.
        verify: a callable taking the value (decoded under a schema, else the answer text) and
            returning True/None (ok), False (refused) or a str (the refusal reason), or a pair
            ``(ok, reason)``. An exception it raises is a refusal naming it.
    """

    def __init__(self, schema: dict | None = None,
                 verify: Callable[[Any], Any] | None = None) -> None:
        self.schema, self.verify = schema, verify
        self._validator = None
        if schema is not None:
            from jsonschema import validators
            self._validator = validators.validator_for(schema)(schema)

    @classmethod
    def from_options(cls, opts: Any) -> "AnswerCheck | None":
        """The check a run's options ask of the root loop (None when there is none)."""
        schema, verify = getattr(opts, "answer_schema", None), getattr(opts, "verify", None)
        if schema is None and verify is None:
            return None
        return cls(to_json_schema(schema), verify)

    def instructions(self) -> str:
        """The text appended to the task so the model knows what FINAL must hold."""
        parts = []
        if self.schema is not None:
            parts.append("The answer must be JSON data matching this JSON Schema; call "
                         "FINAL(value) with a dict/list/value (or its JSON text):\n"
                         + json.dumps(self.schema, ensure_ascii=False, sort_keys=True))
        if self.verify is not None:
            parts.append("The answer is checked before it is accepted; if it is refused you "
                         "will be told why.")
        return "\n\n".join(parts)

    def check(self, answer: str) -> Verdict:
        """Check one FINAL value (the answer text the kernel reported)."""
        value: Any = answer
        text = answer
        if self.schema is not None:
            value, reason = self._validate(answer)
            if reason:
                return Verdict(False, None, reason, value, "schema")
            try:
                text = json.dumps(_jsonable(value), ensure_ascii=False)
            except (TypeError, ValueError) as exc:
                return Verdict(False, None, f"not JSON data: {exc}", value, "schema")
        if self.verify is not None:
            ok, reason = self._gate(value)
            if not ok:
                return Verdict(False, None, reason, value, "verify")
        return Verdict(True, text, "", value, "")

    def _validate(self, answer: str) -> tuple[Any, str]:
        value = _jsonable(decode_answer(answer))
        err = self._first_error(value)
        if err and isinstance(answer, str) and value != answer and self._first_error(answer) is None:
            return answer, ""  # a string schema: the text itself is the value
        return value, err or ""

    def _first_error(self, value: Any) -> str | None:
        from jsonschema.exceptions import best_match
        err = best_match(self._validator.iter_errors(value))
        if err is None:
            return None
        where = "/".join(str(p) for p in err.absolute_path)
        return f"{err.message}" + (f" (at {where})" if where else "")

    def _gate(self, value: Any) -> tuple[bool, str]:
        try:
            got = self.verify(value)
        except Exception as exc:  # noqa: BLE001 - a raising gate refuses, with its message
            return False, f"{type(exc).__name__}: {exc}"
        if isinstance(got, tuple) and len(got) == 2:
            ok, reason = got
            return bool(ok), "" if ok else str(reason or "refused")
        if got is None or got is True or (isinstance(got, str) and got.strip().lower() == "ok"):
            return True, ""
        if got is False:
            return False, "refused"
        return False, str(got)


# --------------------------------------------------------------------------- depth-limit children

def _strip_fences(text: str) -> str:
    t = text.strip()
    if t.startswith("```"):
        t = t.split("\n", 1)[1] if "\n" in t else ""
        t = t.rsplit("```", 1)[0]
    return t.strip()


def checked_completion(run: Any, stage: Any, prompt: str, check: AnswerCheck,
                       tries: int = 3, scope: Any = None) -> str:
    """A depth-limit ``rlm(..., schema=)``: a plain completion whose reply must pass ``check``.

    Runs inside the pending ``fallback`` ``stage``: up to ``tries`` model calls (to the
    sub-call endpoint when the run has one), each refused reply answered with the validation
    error. Every verdict is evidence on the stage.
    ``scope``: the calling cell's cancel scope (its interrupt stops the calls).

    Returns:
        the accepted answer (canonical JSON text).
    Raises:
        ChildRLMError: no reply passed in ``tries`` calls (the stage ends ``failed``).
        BudgetExceeded, EndpointError, Cancelled: as ``RunTree.model_call``.
    """
    from harness.stages.tree import Status

    from rlm.errors import ChildRLMError
    verdicts: list[dict] = []
    messages = [{"role": "user", "content": f"{prompt}\n\n{check.instructions()}\n"
                 "Reply with the JSON value only."}]
    with run.stage(existing=stage) as sc:
        for _ in range(max(1, tries)):
            comp = run.model_call(sc.id, sc.level, messages, stage.model,
                                  run.opts.sub_max_tokens, scope=scope, sub=True)
            verdict = check.check(_strip_fences(comp.text))
            verdicts.append(verdict.evidence())
            sc.evidence = {"answer": verdict.answer, "checks": verdicts}
            if verdict.ok:
                return verdict.answer  # type: ignore[return-value]
            messages += [{"role": "assistant", "content": comp.text},
                         {"role": "user", "content": f"Not accepted: {verdict.reason}\n"
                                                     "Reply with the corrected JSON value only."}]
        reason = f"no reply matched the schema in {len(verdicts)} tries: {verdicts[-1]['reason']}"
        sc.finish(Status.failed, reason)
    raise ChildRLMError(f"child {stage.id}: {reason}", "failed", reason)
