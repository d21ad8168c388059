"""A JSON schema that uses what our rules (schema.py) do not enforce (`pattern`, `format`, numeric
ranges) goes through xgrammar's own JSON-schema converter instead, as EBNF text folded into our
`Rules` (so a think block may still come first), with our guarantees kept: compact separators
(", " and ": ", no other whitespace) and numbers of at most 19 integer and 16 fraction digits."""

from __future__ import annotations

import json
import re
from typing import Any

from engine.grammars.schema import Rules

# The keywords xgrammar's converter enforces and ours does not (api/grammars/response_format.py).
XGRAMMAR_KEYWORDS = frozenset({"pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
MAX_INTEGER_DIGITS = 19
MAX_FRACTION_DIGITS = 16
# A string literal, a character class, or a name: only names are rules to rename.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")


def needs_xgrammar(schema: Any) -> bool:
    """Whether any node of `schema` uses a keyword only xgrammar's converter enforces. NOTE: a
    property named like one of them counts too; that costs nothing but the other converter."""
    if isinstance(schema, dict):
        return any(k in XGRAMMAR_KEYWORDS for k in schema) or any(needs_xgrammar(v) for v in schema.values())
    if isinstance(schema, list):
        return any(needs_xgrammar(v) for v in schema)
    return False


def xgrammar_value(rules: Rules, schema: Any) -> str:
    """A rule for one JSON value that fits `schema`, by xgrammar's converter, added to `rules`."""
    import xgrammar

    text = str(
        xgrammar.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True
        )
    )
    # Bounded numbers: xgrammar writes `[0-9]*` for integer digits and `{1, -1}` repeats of a digit.
    text = text.replace("[0-9]*", f"[0-9]{{0,{MAX_INTEGER_DIGITS - 1}}}")
    text = text.replace("basic_number_digits{1, -1}", f"basic_number_digits{{1, {MAX_FRACTION_DIGITS}}}")
    parsed = [_RULE.match(line) for line in text.splitlines() if line.strip()]
    assert all(parsed), f"xgrammar's grammar has a line that is not a rule: {text[:200]!r}"
    names = {m.group(1): rules.reserve(f"xg_{m.group(1)}") for m in parsed if m}

    def rename(token: re.Match[str]) -> str:
        return names.get(token.group(0), token.group(0))

    for m in parsed:
        if m:
            rules.define(names[m.group(1)], _TOKEN.sub(rename, m.group(2)))
    return names["root"]
