"""vLLM's `structured_outputs.structural_tag`: xgrammar's structural tag as grammar text. Two forms,
as vLLM reads them: the current one (`{"type": "structural_tag", "format": {...}}`: tags, triggered
tags, sequences, JSON schemas inside) and the older `{"structures": [{"begin", "schema", "end"}],
"triggers": [...]}` (free text until a trigger, then the tag whose `begin` it starts)."""

from __future__ import annotations

import json


def structural_tag_ebnf(text: str) -> str:
    """The EBNF (xgrammar's dialect) of the structural tag in `text` (JSON); ValueError saying why
    when it is not one."""
    import xgrammar

    try:
        tag = json.loads(text)
    except ValueError as e:
        raise ValueError(f"structural_tag is not JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be a JSON object")
    try:
        if "structures" in tag:  # the older form, which vLLM still accepts
            items = [
                xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in tag["structures"]
            ]
            grammar = xgrammar.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))
        else:
            grammar = xgrammar.Grammar.from_structural_tag(text)
    except (KeyError, TypeError) as e:
        raise ValueError(f"structural_tag: each of structures needs begin, schema and end ({e})") from None
    except Exception as e:  # xgrammar's InvalidJSONError / InvalidStructuralTagError / RuntimeError
        raise ValueError(f"invalid structural_tag: {str(e).splitlines()[-1][:300]}") from None
    return str(grammar)
