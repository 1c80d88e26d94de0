"""Grammars of structured outputs: what a request's ``StructuredOutputsParams`` asks for, as one
normalised spec (its cache key), checked before the request is accepted, and compiled for a
tokenizer by xgrammar.

The check runs in the API process (and the offline ``LLM``) before anything is queued: the spec is
bounded in size, parsed by xgrammar without a tokenizer (fast: no token tables), under a time
bound, and a JSON schema is refused if it uses a keyword xgrammar would silently ignore, since an
output that "validates" against a schema with a constraint dropped is not what the caller asked
for. Compiling (token tables, per tokenizer) happens in the engine core
(``engine.structured_outputs``).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import SamplingParamsError, StructuredOutputsParams

MAX_SPEC_BYTES = 64 * 1024
CHECK_TIMEOUT_S = 1.0

# JSON-schema keywords xgrammar accepts but does not enforce: refused instead of ignored.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "multipleOf",
    }
)
# Where a schema holds further schemas: a mapping of names to schemas, or one schema, or a list.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


class GrammarError(SamplingParamsError):
    """A grammar the engine cannot enforce (bad syntax, an unsupported feature, too large or slow)."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint, normalised: ``kind`` is json, json_object, regex or grammar (choices become
    a grammar); ``text`` the schema (canonical JSON), regex or EBNF. Equal specs compile alike."""

    kind: str
    text: str
    any_whitespace: bool = False

    @property
    def param(self) -> str:
        return f"structured_outputs.{self.kind}"


def grammar_spec(params: StructuredOutputsParams, any_whitespace: bool = False) -> GrammarSpec:
    """The spec of ``params``; ``any_whitespace`` is the engine's default for JSON whitespace."""
    if params.disable_any_whitespace is not None:
        any_whitespace = not params.disable_any_whitespace
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise GrammarError("structured_outputs.json", f"is not valid JSON: {error}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("structured_outputs.json", "a JSON schema is an object (or true/false)")
        return GrammarSpec("json", json.dumps(schema, sort_keys=True, separators=(",", ":")), any_whitespace)
    if kind == "json_object":
        return GrammarSpec("json_object", "", any_whitespace)
    if kind == "choice":
        assert params.choice is not None
        # JSON string literals are xgrammar EBNF string literals (same escapes); characters beyond the
        # BMP stay themselves (xgrammar reads no surrogate-pair escapes).
        literals = (json.dumps(choice, ensure_ascii=False) for choice in params.choice)
        return GrammarSpec("grammar", "root ::= " + " | ".join(literals))
    text = params.regex if kind == "regex" else params.grammar
    assert text is not None
    return GrammarSpec(kind, text)


def check_grammar(spec: GrammarSpec) -> None:
    """Raise :class:`GrammarError` (naming the field) unless xgrammar can enforce ``spec``: within
    ``MAX_SPEC_BYTES``, parsed within ``CHECK_TIMEOUT_S``, no ignored schema keyword."""
    try:
        size = len(spec.text.encode())
    except UnicodeEncodeError:
        raise GrammarError(spec.param, "is not valid Unicode (a lone surrogate)") from None
    if size > MAX_SPEC_BYTES:
        raise GrammarError(spec.param, f"is {size} bytes; at most {MAX_SPEC_BYTES} are accepted")
    if spec.kind == "json":
        schema = json.loads(spec.text)
        found = sorted(_unsupported_keywords(schema))
        if found:
            raise GrammarError(spec.param, f"uses JSON-schema keywords that cannot be enforced: {', '.join(found)}")
        if _pattern_with_length(schema):
            # xgrammar enforces the pattern and drops the length bounds.
            raise GrammarError(
                spec.param,
                "a string with both a pattern and minLength/maxLength cannot be enforced: "
                "put the length into the pattern",
            )
    import xgrammar  # noqa: F401 - imported here, outside the parse's time bound (a slow first import)

    outcome: list[BaseException | None] = []

    def parse() -> None:
        try:
            grammar_of(spec)
            outcome.append(None)
        except BaseException as error:  # reported to the caller below
            outcome.append(error)

    # A thread, so a pathological spec costs this request its time bound, not the server its loop;
    # the parse cannot be interrupted, but it ends on its own (parsing has no search).
    worker = threading.Thread(target=parse, name="grammar-check", daemon=True)
    worker.start()
    worker.join(CHECK_TIMEOUT_S)
    if not outcome:
        raise GrammarError(spec.param, f"took longer than {CHECK_TIMEOUT_S:g} s to parse")
    error = outcome[0]
    if error is not None:
        raise GrammarError(spec.param, f"cannot be enforced: {_first_line(error)}")


# xgrammar (0.2.9) writes a length-bounded JSON string's characters as this class, which lets raw
# control characters through (invalid JSON: RFC 8259 wants them escaped); its other string rules
# exclude them. The JSON grammars are rewritten with the strict class before they are compiled.
_LOOSE_STRING_CHARACTER = r"[^\"\\\r\n]"
_STRICT_STRING_CHARACTER = r"[^\"\\\0-\x1f]"


def grammar_of(spec: GrammarSpec) -> Any:
    """The xgrammar ``Grammar`` of ``spec`` (no tokenizer needed); raises on a bad spec."""
    import xgrammar

    if spec.kind in ("json", "json_object"):
        schema = spec.text if spec.kind == "json" else '{"type":"object"}'
        text = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=spec.any_whitespace))
        text = text.replace(_LOOSE_STRING_CHARACTER, _STRICT_STRING_CHARACTER)
    elif spec.kind == "regex":
        text = str(xgrammar.Grammar.from_regex(spec.text))
    else:
        text = str(xgrammar.Grammar.from_ebnf(spec.text))  # parsed and printed: no comments, one dialect
    return xgrammar.Grammar.from_ebnf(_without_surrogates(text))


# xgrammar (0.2.9) matches a character class over UTF-8 byte sequences of any code point up to
# U+10FFFF, surrogates included: a negated class or "." lets a byte-level tokenizer spell U+D800 to
# U+DFFF as three bytes, which are not UTF-8 (the text shows U+FFFD, one character per byte, and a
# string's maxLength no longer holds). No valid text contains a surrogate, so excluding them from
# every negated class and from the any-character class changes nothing a caller can ask for.
_SURROGATES = r"\ud800-\udfff"
_ANY_CHARACTER = r"[\0-\U0010ffff]"
_LITERAL_OR_CLASS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')


def _without_surrogates(text: str) -> str:
    """``text`` (xgrammar's printed EBNF) with surrogates taken out of its negated and any-character
    classes; string literals, including a ``Regex("...")`` node's pattern, are left as they are."""

    def rewrite(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == _ANY_CHARACTER:
            return r"[\0-\ud7ff\ue000-\U0010ffff]"
        if token.startswith("[^"):
            return token[:-1] + _SURROGATES + "]"
        return token

    return _LITERAL_OR_CLASS.sub(rewrite, text)


def json_schema_rules(schema: dict[str, Any], rule: str, any_whitespace: bool = False) -> str:
    """EBNF rules (xgrammar's dialect) for JSON valid against ``schema``, its top rule named ``rule``:
    to embed a JSON value in a larger grammar (a tool call's markup around its arguments)."""
    import xgrammar

    text = str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace))
    text = text.replace(_LOOSE_STRING_CHARACTER, _STRICT_STRING_CHARACTER)
    # Its rules are "root" and "root_..." / "basic_...": only the top rule's own name changes, and
    # never inside a string literal or a character class.
    return _ROOT_REFERENCE.sub(lambda match: rule if match.group(0) == "root" else match.group(0), text)


_ROOT_REFERENCE = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\broot\b(?!_)')


def _subschemas(schema: Any) -> list[dict[str, Any]]:
    """Every schema object within ``schema``, itself included."""
    found: list[dict[str, Any]] = []
    pending = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        found.append(node)
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                pending.extend(node[key].values())
        for key in _SCHEMA_ONE:
            if isinstance(node.get(key), dict):
                pending.append(node[key])
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                pending.extend(node[key])
    return found


def _unsupported_keywords(schema: Any) -> set[str]:
    return {keyword for node in _subschemas(schema) for keyword in UNSUPPORTED_SCHEMA_KEYWORDS.intersection(node)}


def _pattern_with_length(schema: Any) -> bool:
    return any("pattern" in node and ("minLength" in node or "maxLength" in node) for node in _subschemas(schema))


def _first_line(error: BaseException) -> str:
    """xgrammar's message without its source location prefix (``[time] file.cc:N: ``)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    marker = text.find(": ", text.find(".cc:"))
    return text[marker + 2 :] if text.startswith("[") and marker > 0 else text
