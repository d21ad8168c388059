"""vLLM's structured-output request fields on /v1/chat/completions and /v1/completions, as a
`ResponseFormat`: `structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object" |
"structural_tag": ...}, exactly one) and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. Their errors follow vLLM's wording; a regex, a grammar or a structural tag is
checked by the engine (engine/structured_output/manager.py `check`: 400 naming `regex`, `grammar`
or `structural_tag`)."""

from __future__ import annotations

import json
from typing import Any

from api.errors import bad_request
from api.grammars.response_format import JSON_OBJECT, JSON_SCHEMA, ResponseFormat, SchemaError, check_schema

PARAM = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def parse_vllm_fields(structured_outputs: Any, guided: dict[str, Any]) -> ResponseFormat | None:
    """The format vLLM's fields ask for, None when none is set; APIError (400) for a malformed or
    ambiguous one. `guided`: the request's guided_* fields by name (None where absent)."""
    asked = {GUIDED[name]: value for name, value in guided.items() if value is not None}
    param = next((name for name, value in guided.items() if value is not None), PARAM)
    if structured_outputs is not None:
        if asked:
            raise bad_request(f"structured_outputs cannot be combined with {', '.join(sorted(GUIDED))}; use one", PARAM)
        if not isinstance(structured_outputs, dict):
            raise bad_request('structured_outputs must be an object such as {"choice": ["yes", "no"]}', PARAM)
        asked = {k: v for k, v in structured_outputs.items() if k in KINDS and v not in (None, False)}
        if not asked:
            raise bad_request(
                "You must use one kind of structured outputs constraint but none are specified: "
                f"set one of {', '.join(KINDS)}",
                PARAM,
            )
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(
            "You can only use one kind of structured outputs constraint but multiple are specified: "
            f"{', '.join(sorted(asked))}",
            param,
        )
    [(kind, value)] = asked.items()
    if kind == "json":
        return _json(value, param)
    if kind == "json_object":
        return ResponseFormat(JSON_OBJECT)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise bad_request("regex must be a non-empty string", param)
        return ResponseFormat("regex", text=value)
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise bad_request("grammar must be a non-empty string (EBNF, xgrammar's dialect)", param)
        return ResponseFormat("grammar", text=value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request("choice must be a non-empty list of strings", param)
        # One literal per choice: json.dumps writes the escapes xgrammar's EBNF strings read.
        return ResponseFormat("choice", text="root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    # structural_tag: xgrammar's JSON (a string, as vLLM takes it, or the object itself); the engine
    # checks it (engine/grammars/structural_tag.py: 400 naming structural_tag).
    if isinstance(value, dict):
        value = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str) or not value.strip():
        raise bad_request("structural_tag must be xgrammar's structural tag as JSON text", param)
    return ResponseFormat("structural_tag", text=value)


def _json(value: Any, param: str) -> ResponseFormat:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request("json must be a JSON schema (an object, or its JSON text)", param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request("json must be a JSON schema (an object, or its JSON text)", param)
    try:
        check_schema(value)
    except SchemaError as e:
        raise bad_request(f"invalid JSON schema: {e}", param) from None
    return ResponseFormat(JSON_SCHEMA, value, name="structured_outputs")
