"""`python -m bench.structured_compile`: our grammar rules against xgrammar's own compilers.

For each schema (a small object, a nested agent tool, an enum of 10,000 strings) it compiles, on the
151,936-token Qwen3 vocabulary with one compiler thread and no xgrammar cache (as
engine/structured_output/manager.py builds its compiler):
- ours: the engine's EBNF for a `StructuredOutput` (engine/grammars/), json_schema or a forced
  tool call;
- xgr-json: `GrammarCompiler.compile_json_schema(schema, any_whitespace=False,
  separators=(", ", ": "))`;
- xgr-tag: a forced tool call as xgrammar's builtin Qwen3 structural tag
  (`get_builtin_structural_tag("qwen_3", ...)`, `compile_structural_tag`).
and prints the best compile time of --repeats, then walks a matcher along one valid document token
by token and prints the mean and worst `fill_next_token_bitmask` time per token. Then it checks
which guarantees each compiler gives (compact separators, bounded numbers, an escape counting as
one character against maxLength, the document of each schema accepted).

Imports engine/ and xgrammar inside functions (bench/ stays an HTTP client at module level).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

SMALL = {
    "type": "object",
    "properties": {
        "mode": {"enum": ["fast", "slow"]},
        "level": {"type": "integer"},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 12},
    },
    "required": ["mode", "level", "ok", "name"],
    "additionalProperties": False,
}
SMALL_DOC = {"mode": "fast", "level": 3, "ok": True, "name": "ab cd"}
NESTED = {  # an agent's edit tool: nested objects in an array, enums, a $ref, optional members
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "edits": {"type": "array", "items": {"$ref": "#/$defs/edit"}, "minItems": 1},
        "mode": {"enum": ["replace", "insert", "delete"]},
        "options": {"type": "object", "properties": {"dry_run": {"type": "boolean"}, "context": {"type": "integer"}}},
    },
    "required": ["path", "edits"],
    "$defs": {
        "edit": {
            "type": "object",
            "properties": {"old": {"type": "string"}, "new": {"type": "string"}, "line": {"type": ["integer", "null"]}},
            "required": ["old", "new"],
        }
    },
}
NESTED_DOC = {
    "path": "src/main.py",
    "edits": [{"old": "x = 1", "new": "x = 2", "line": 4}, {"old": "y", "new": "z"}],
    "mode": "replace",
    "options": {"dry_run": False, "context": 3},
}
ENUM = {"type": "string", "enum": [f"value-{i:05d}" for i in range(10_000)]}
ENUM_DOC = "value-04321"
SCHEMAS = {"small object": (SMALL, SMALL_DOC), "nested tool": (NESTED, NESTED_DOC), "10k enum": (ENUM, ENUM_DOC)}
TOOL_NAME = "edit"


def compiler() -> tuple[Any, Any]:
    """(GrammarCompiler, tokenizer) for the demo checkpoint's Qwen3 vocabulary, built as
    engine/structured_output/manager.py builds its own."""
    import xgrammar
    from transformers import AutoTokenizer

    from engine.weights.demo_model import ensure_demo_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model()), local_files_only=True)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=151_936)
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False), tokenizer


def variants(schema: Any) -> dict[str, Callable[[Any], Any]]:
    """name -> compile(compiler) for one schema, and the text each must accept."""
    import xgrammar

    from engine.grammars import ebnf
    from scheduler.structured_output import StructuredOutput, ToolSpec, canonical_json

    tool = StructuredOutput.tool_calls((ToolSpec(TOOL_NAME, canonical_json(schema)),), "qwen3", parallel=False)
    tag = xgrammar.get_builtin_structural_tag(
        "qwen_3",
        tools=[{"type": "function", "function": {"name": TOOL_NAME, "parameters": schema}}],
        tool_choice={"type": "function", "function": {"name": TOOL_NAME}},
        reasoning="disabled",
    )
    return {
        "ours json_schema": lambda c: c.compile_grammar(ebnf(StructuredOutput.json_schema(schema))),
        "xgr compile_json_schema": lambda c: c.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True
        ),
        "ours tool_calls": lambda c: c.compile_grammar(ebnf(tool)),
        "xgr structural tag": lambda c: c.compile_structural_tag(tag),
    }


def document(name: str, doc: Any) -> str:
    text = json.dumps(doc, ensure_ascii=False)
    if "json" in name:
        return text
    return f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {text}}}\n</tool_call>'


def mask_times(compiled: Any, tokenizer: Any, text: str) -> tuple[float, float, bool]:
    """(mean ms, worst ms) of fill_next_token_bitmask along `text`'s tokens, and whether the
    matcher accepted every token and then terminated."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, 151_936)
    times = []
    accepted = True
    for token in tokenizer.encode(text, add_special_tokens=False):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append((time.perf_counter() - t0) * 1e3)
        accepted = accepted and matcher.accept_token(token)
    return statistics.mean(times), max(times), accepted and matcher.is_completed()


def guarantees(c: Any) -> None:
    """What each compiler lets through, on strings the schema (or our compact rule) does or does
    not allow."""
    import xgrammar

    from engine.grammars import ebnf
    from scheduler.structured_output import StructuredOutput, ToolSpec, canonical_json

    cases = [
        (
            "compact only: refuses '{\"a\":1}'",
            {"type": "object", "properties": {"a": {"type": "integer"}}},
            '{"a":1}',
            False,
        ),
        ("numbers bounded: refuses 40 digits", {"type": "integer"}, "1" * 40, False),
        ("maxLength 2 takes '\"\\n\\t\"' (two characters)", {"type": "string", "maxLength": 2}, '"\\n\\t"', True),
        ("pattern ^[a-z]+$ refuses '\"A1\"'", {"type": "string", "pattern": "^[a-z]+$"}, '"A1"', False),
        ("minimum 1 refuses 0", {"type": "integer", "minimum": 1}, "0", False),
    ]
    for what, schema, text, want in cases:
        row = []
        for name, compiled in (
            ("ours", c.compile_grammar(ebnf(StructuredOutput.json_schema(schema)))),
            ("xgrammar", c.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))),
        ):
            matcher = xgrammar.GrammarMatcher(compiled)
            got = matcher.accept_string(text) and matcher.is_completed()
            row.append(f"{name} {'yes' if got == want else 'NO'}")
        print(f"  {what}: {', '.join(row)}")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": TOOL_NAME, "parameters": schema}}]
    ours = StructuredOutput.tool_calls((ToolSpec(TOOL_NAME, canonical_json(schema)),), "qwen3", parallel=True)
    compiled = {
        "ours": c.compile_grammar(ebnf(ours)),
        "xgrammar tag": c.compile_structural_tag(
            xgrammar.get_builtin_structural_tag("qwen_3", tools=tools, tool_choice="required", reasoning="disabled")
        ),
    }
    call = '<tool_call>\n{"name": "edit", "arguments": ARGS}\n</tool_call>'
    cases = [
        ("a call with '{\"a\":1}' refused (not compact)", call.replace("ARGS", '{"a":1}')),
        ("a call with '{\"a\": 1 }' refused (padded)", call.replace("ARGS", '{"a": 1 }')),
        (
            "text between two calls refused",
            call.replace("ARGS", '{"a": 1}') + "\nsome text\n" + call.replace("ARGS", '{"a": 2}'),
        ),
    ]
    for what, text in cases:
        row = []
        for name, grammar in compiled.items():
            matcher = xgrammar.GrammarMatcher(grammar)
            got = matcher.accept_string(text) and matcher.is_completed()
            row.append(f"{name} {'NO' if got else 'yes'}")
        print(f"  {what}: {', '.join(row)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.structured_compile", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="compiles per grammar; the best is reported")
    parser.add_argument("--guarantees-only", action="store_true", help="skip the timings")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    c, tokenizer = compiler()
    print(f"compiler built in {time.perf_counter() - t0:.1f} s (151,936 tokens, 1 thread, cache off)")
    c.compile_grammar('root ::= "warm"')  # the first compile pays one-time set-up: not any variant's
    if args.guarantees_only:
        guarantees(c)
        return
    print(
        f"{'schema':<14} {'variant':<24} {'compile ms':>10} {'mask mean ms':>12} {'mask max ms':>11} {'MiB':>6}  accepted"  # noqa: E501
    )
    for label, (schema, doc) in SCHEMAS.items():
        for name, compile_one in variants(schema).items():
            repeats = 1 if label == "10k enum" else args.repeats
            best, compiled = float("inf"), None
            for _ in range(repeats):
                t0 = time.perf_counter()
                compiled = compile_one(c)
                best = min(best, (time.perf_counter() - t0) * 1e3)
            mean, worst, ok = mask_times(compiled, tokenizer, document(name, doc))
            size = compiled.memory_size_bytes / (1 << 20)
            print(f"{label:<14} {name:<24} {best:>10.1f} {mean:>12.3f} {worst:>11.2f} {size:>6.1f}  {ok}")
    print("guarantees (yes: as the schema and our compact rule want):")
    guarantees(c)


if __name__ == "__main__":
    main()
