"""JSON values that fit a JSON schema, as EBNF in xgrammar's dialect: `SchemaGrammar` turns one
schema into rules of a `Rules` set (shared JSON rules, unique names, reuse of equal bodies), and
`Rules.with_reasoning` puts a think block before them. Plain text: engine/grammars/tools.py builds
tool-call grammars from it, engine/structured_output/manager.py compiles the result (why these rules and not
xgrammar's own converter: its docstring)."""

from __future__ import annotations

import json
import re
from typing import Any

from scheduler.structured_output import Reasoning, ThinkTags

# Schemas nested deeper than this take any JSON value there (bounds the grammar's size).
MAX_SCHEMA_DEPTH = 24
# minLength / maxLength up to this many characters are enforced. NOTE: each enforced character is
# one grammar rule (a chain of right-recursive rules: a bounded repetition `{0,n}` made in-string
# masks take up to ~350 ms each), and xgrammar compiles each rule against the whole vocabulary,
# 25-40 ms on a 150k vocabulary. Larger bounds are not enforced: there the grammar allows more.
MAX_STRING_LENGTH_BOUND = 32
# One string character: anything but a quote, a backslash or a control character, or an escape.
_CHAR_THEN = r'[^"\\\x00-\x1f] {next} | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{{4}} ) {next}'

# NOTE: JSON is compact, with json.dumps' separators (", " and ": ") and no other whitespace: the
# form chat templates render tool calls in (transformers' `tojson`), so the form models learn. Any
# whitespace between tokens let a weak or quantized model fill its budget with "\n\t" and never
# finish (why vLLM grew --disable-any-whitespace; xgrammar's any_whitespace=False does the same).
# Numbers are bounded for the same reason: 19 integer digits (int64), 16 fraction digits.
COMMA, COLON = '", "', '": "'
_BASE_RULES = {
    # Around think blocks and between calls: the template's own newlines ("</think>\n\n", one
    # "\n" between two calls), and no other whitespace.
    "blank": r"[\n]{0,2}",
    # NOTE: right recursion, not `"\"" char* "\""`: xgrammar caches token masks per rule
    # position, and a starred alternation made every in-string mask ~150 ms on a 150k vocabulary.
    "json_string": r'"\"" json_string_rest',
    "json_string_rest": r'"\"" | [^"\\\x00-\x1f] json_string_rest | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) json_string_rest',  # noqa: E501
    "json_uint": r'"0" | [1-9] [0-9]{0,18}',
    "json_integer": r'"-"? json_uint',
    "json_number": r'"-"? json_uint ( "." [0-9]{1,16} )? ( [eE] [+-]? [0-9]{1,3} )?',
    "json_value": r'json_object | json_array | json_string | json_number | "true" | "false" | "null"',
    "json_member": f"json_string {COLON} json_value",
    "json_object": f'"{{" ( json_member ( {COMMA} json_member )* )? "}}"',
    "json_array": f'"[" ( json_value ( {COMMA} json_value )* )? "]"',
}
_BASE_DEPENDS = {
    "json_string": ("json_string_rest",),
    "json_integer": ("json_uint",),
    "json_number": ("json_uint",),
    "json_value": ("json_object", "json_array", "json_string", "json_number"),
    "json_member": ("json_string", "json_value"),
    "json_object": ("json_member",),
    "json_array": ("json_value",),
}


class SchemaGrammar:
    """One JSON schema as EBNF rules. Covers type (and type lists), properties/required,
    additionalProperties, items/minItems/maxItems, enum, const, anyOf/oneOf, allOf of one,
    $ref into $defs/definitions (recursive ones too), nullable, a non-negative minimum, and
    minLength/maxLength up to MAX_STRING_LENGTH_BOUND. Other keywords (pattern, format, numeric
    ranges, uniqueItems, ...) are not enforced: there the grammar allows more than the schema.
    NOTE: it allows less in one way, as xgrammar's strict mode does: properties come in the
    schema's order and undeclared ones are refused."""

    def __init__(self, rules: Rules, root: Any) -> None:
        self.rules = rules
        self.root = root if isinstance(root, dict) else {}
        self._refs: dict[str, str] = {}

    def arguments(self) -> str:
        """A tool's `arguments`: an object, `{}` for a function without parameters."""
        if not self.root:
            return '"{}"'
        return self.value({**self.root, "type": "object"} if "type" not in self.root else self.root, 0)

    def value(self, schema: Any, depth: int) -> str:
        """An EBNF expression for the JSON values `schema` allows; `depth`: its nesting level."""
        if not isinstance(schema, dict) or not schema or depth > MAX_SCHEMA_DEPTH:
            return self.rules.base("json_value")
        if "$ref" in schema:
            return self._ref(schema["$ref"], depth)
        expr = self._value(schema, depth)
        return f'( {expr} | "null" )' if schema.get("nullable") is True else expr

    def _value(self, schema: dict[str, Any], depth: int) -> str:
        if "const" in schema:
            return self._constant(schema["const"])
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return "( " + " | ".join(self._constant(v) for v in enum) + " )"
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                return "( " + " | ".join(self.value(o, depth + 1) for o in options) + " )"
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and len(all_of) == 1:
            return self.value(all_of[0], depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if isinstance(k, str)]
            return (
                "( " + " | ".join(self._typed(schema, k, depth) for k in kinds) + " )"
                if kinds
                else self.rules.base("json_value")
            )
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        return self._typed(schema, kind, depth) if isinstance(kind, str) else self.rules.base("json_value")

    def _typed(self, schema: dict[str, Any], kind: str, depth: int) -> str:
        base = self.rules.base
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number"):
            rule = base("json_integer" if kind == "integer" else "json_number")
            floor = schema.get("minimum", schema.get("exclusiveMinimum"))
            if isinstance(floor, (int, float)) and not isinstance(floor, bool) and floor >= 0:
                return self.rules.add(f"nonneg_{kind}", _BASE_RULES[rule].removeprefix('"-"? '))
            return rule
        if kind == "boolean":
            return '( "true" | "false" )'
        if kind == "null":
            return '"null"'
        return base("json_value")

    def _string(self, schema: dict[str, Any]) -> str:
        """A string of minLength..maxLength characters (an escape counts as one), each bound
        enforced up to MAX_STRING_LENGTH_BOUND."""
        lo, hi = _count(schema, "minLength") or 0, _count(schema, "maxLength")
        lo = lo if lo <= MAX_STRING_LENGTH_BOUND else 0
        hi = hi if hi is not None and lo <= hi <= MAX_STRING_LENGTH_BOUND else None
        if lo == 0 and hi is None:
            return self.rules.base("json_string")
        # rest: the string after its opening quote, closing quote included; built from its end.
        rest = self.rules.base("json_string_rest") if hi is None else '"\\""'
        for k in range(hi - lo if hi is not None else 0):  # up to hi - lo more characters
            rest = self.rules.add(f"string_max_{k + 1}", f'"\\"" | {_CHAR_THEN.format(next=rest)}')
        for k in range(lo):  # then lo characters that must come first
            rest = self.rules.add(f"string_min_{k + 1}", _CHAR_THEN.format(next=rest))
        return f'( "\\"" {rest} )'

    def _object(self, schema: dict[str, Any], depth: int) -> str:
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if not isinstance(properties, dict):
            if extra is False:
                return '"{}"'
            if isinstance(extra, dict) and extra:
                member = f"{self.rules.base('json_string')} {COLON} {self.value(extra, depth + 1)}"
                return self.rules.add("map", f'"{{" ( {member} ( {COMMA} {member} )* )? "}}"')
            return self.rules.base("json_object")
        required = required_keys(schema, properties)
        members = [
            f"{literal(json.dumps(k, ensure_ascii=False) + ': ')} {self.value(v, depth + 1)}"
            for k, v in properties.items()
        ]
        keys = list(properties)
        # rest[i]: members i.. each after a comma (those not required optional); the first member
        # written is any j with only optional members before it.
        rest = ['""'] * (len(members) + 1)
        for i in range(len(members) - 1, 0, -1):
            item = f"{COMMA} {members[i]}"
            body = item if keys[i] in required else f"( {item} )?"
            rest[i] = self.rules.add("rest", body if rest[i + 1] == '""' else f"{body} {rest[i + 1]}")
        firsts = []
        for j, member in enumerate(members):
            firsts.append(f"{member} {rest[j + 1]}")
            if keys[j] in required:
                break
        else:
            firsts.append('""')
        return self.rules.add("object", f'"{{" ( {" | ".join(firsts)} ) "}}"')

    def _array(self, schema: dict[str, Any], depth: int) -> str:
        items = schema.get("items")
        item = self.value(items, depth + 1) if isinstance(items, dict) else self.rules.base("json_value")
        lo, hi = _count(schema, "minItems") or 0, _count(schema, "maxItems")
        if hi is not None and hi < lo:
            hi = lo
        if hi == 0:
            return '"[]"'
        more = f"( {COMMA} {item} )"
        more += "*" if hi is None and lo <= 1 else f"{{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        inner = f"{item} {more}" if lo >= 1 else f"( {item} {more} )?"
        return self.rules.add("array", f'"[" {inner} "]"')

    def _constant(self, value: Any) -> str:
        """Exactly `value`, written compactly like any other JSON."""
        if not isinstance(value, (dict, list)):
            return literal(json.dumps(value, ensure_ascii=False))
        if isinstance(value, dict):
            parts = [
                f"{literal(json.dumps(k, ensure_ascii=False) + ': ')} {self._constant(v)}" for k, v in value.items()
            ]
            opening, closing = '"{"', '"}"'
        else:
            parts = [self._constant(v) for v in value]
            opening, closing = '"["', '"]"'
        return f"( {opening} {f' {COMMA} '.join(parts)} {closing} )"

    def _ref(self, ref: Any, depth: int) -> str:
        if not isinstance(ref, str):
            return self.rules.base("json_value")
        if ref in self._refs:
            return self._refs[ref]
        if ref == "#":
            target, hint = self.root, "ref_root"
        else:
            match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
            defs = self.root.get(match.group(1)) if match else None
            target = defs.get(match.group(2)) if isinstance(defs, dict) else None
            hint = f"ref_{match.group(2)}" if match else ""
        if not isinstance(target, dict):
            return self.rules.base("json_value")
        name = self._refs[ref] = self.rules.reserve(hint)  # named first: the target may refer back
        self.rules.define(name, self.value(target, depth + 1))
        return name


class Rules:
    """EBNF rules under unique names; a body seen before reuses its rule."""

    def __init__(self) -> None:
        self._bodies: dict[str, str | None] = {}  # name -> body (None: reserved), in order
        self._by_body: dict[str, str] = {}

    def add(self, hint: str, body: str) -> str:
        """The name of a rule with this body: a new one named after `hint`, or the existing one."""
        if body in self._by_body:
            return self._by_body[body]
        name = self.reserve(hint)
        self.define(name, body)
        return name

    def reserve(self, hint: str) -> str:
        """A fresh rule name to `define` later (a rule that may refer to itself)."""
        stem = re.sub(r"[^a-z0-9_]", "_", hint.lower())[:40] or "rule"
        name, k = stem, 1
        while name in self._bodies or name in _BASE_RULES or name == "root":
            name, k = f"{stem}_{k}", k + 1
        self._bodies[name] = None
        return name

    def define(self, name: str, body: str) -> None:
        assert name in self._bodies and self._bodies[name] is None, (
            f"rule {name} was not reserved or is already defined"
        )
        self._bodies[name] = body
        self._by_body.setdefault(body, name)

    def base(self, name: str) -> str:
        """One of the shared rules (_BASE_RULES), defined with what it uses on first use."""
        if name not in self._bodies:
            self._bodies[name] = _BASE_RULES[name]
            for dependency in _BASE_DEPENDS.get(name, ()):
                self.base(dependency)
        return name

    def text_without(self, stops: tuple[str, ...], hint: str) -> str:
        """A rule for any text that contains none of `stops`. NOTE: xgrammar's TagDispatch
        builtin, not a hand-written automaton: compiling one rule per automaton state against a
        150k vocabulary took seconds, this takes milliseconds."""
        excludes = ", ".join(literal(s) for s in stops)
        return self.add(hint, f"TagDispatch(loop_after_dispatch=false, excludes=({excludes}))")

    def with_reasoning(self, body: str, reasoning: Reasoning, think: ThinkTags, blank_first: bool = False) -> str:
        """The whole grammar: `body`, after a think block that the output must close first
        (Reasoning.OPEN: the prompt left it open) or may open itself (Reasoning.OPTIONAL).
        `blank_first`: whitespace may also lead when there is no think block."""
        blank = self.base("blank")
        opening, closing = literal(think.open), literal(think.close)
        if reasoning is Reasoning.OPEN:
            inside = self.text_without((think.close,), "think")
            return self.grammar(f"{inside} {closing} {blank} {body}")
        if reasoning is Reasoning.OPTIONAL:
            inside = self.text_without((think.close,), "think")
            return self.grammar(f"{blank} ( {opening} {inside} {closing} {blank} )? {body}")
        return self.grammar(f"{blank} {body}" if blank_first else body)

    def grammar(self, root: str) -> str:
        """The whole grammar text, `root` being the start rule's body."""
        assert all(body is not None for body in self._bodies.values()), "a reserved rule was never defined"
        lines = [f"root ::= {root}"] + [f"{name} ::= {body}" for name, body in self._bodies.items()]
        return "\n".join(lines) + "\n"


def required_keys(schema: Any, properties: dict[str, Any]) -> set[str]:
    required = schema.get("required") if isinstance(schema, dict) else None
    return {r for r in required if r in properties} if isinstance(required, list) else set()


def _count(schema: dict[str, Any], key: str) -> int | None:
    value = schema.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def escape(text: str) -> str:
    """`text` for the inside of an EBNF string literal."""
    out = []
    for c in text:
        if c in '\\"':
            out.append("\\" + c)
        elif c in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[c])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "".join(out)


def literal(text: str) -> str:
    """An EBNF string literal matching exactly `text`."""
    return f'"{escape(text)}"'
