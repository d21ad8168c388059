"""`fp4serve parse-output`: runs the tool-call and reasoning parsers over a saved model output
and prints the message the API would answer with, to debug a call that did not parse.

    fp4serve parse-output --tool-parser qwen3_coder --tools tools.json < output.txt
    fp4serve parse-output --tool-parser qwen3 --reasoning-parser qwen3 --thinking-in-prompt \\
        --stream-chunk 3 output.txt

Prints one JSON object `{content, reasoning_content, tool_calls, finish_reason}` (tool calls in
OpenAI's shape, `arguments` a JSON string) on stdout, and why any block did not become a call
on stderr. Call ids are `call_` + the call's index in 24 hex digits, so runs compare equal.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from api.parsers import (
    OutputParser,
    UnknownParserError,
    assemble,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from api.parsers.base import ParsedDelta


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", nargs="?", type=Path, help="model output file (default: stdin)")
    parser.add_argument("--tool-parser", default=None, help="qwen3 | qwen3_coder | auto (needs --chat-template)")
    parser.add_argument("--reasoning-parser", default=None, help="qwen3 | auto")
    parser.add_argument(
        "--tools",
        type=Path,
        default=None,
        help="JSON file with the request's `tools` list (or a whole request body); "
        "without it any function name is accepted",
    )
    parser.add_argument(
        "--stream-chunk",
        type=int,
        default=None,
        metavar="N",
        help="feed the parser N characters at a time and assemble the deltas",
    )
    parser.add_argument(
        "--thinking-in-prompt",
        action="store_true",
        help="the prompt ended inside an open <think> block (thinking on, template opened it)",
    )
    parser.add_argument(
        "--finish-reason",
        default="stop",
        choices=("stop", "length", "abort"),
        help="why generation ended, as the engine reports it (default: stop)",
    )
    parser.add_argument("--no-parallel-tool-calls", action="store_true", help="as parallel_tool_calls=false")
    parser.add_argument("--chat-template", type=Path, default=None, help="for `auto` parsers")


def run(args: argparse.Namespace) -> int:
    try:
        text = _read_input(args.input)
        tools = _read_tools(args.tools)
        template = args.chat_template.read_text(encoding="utf-8") if args.chat_template else None
        tool_parser = resolve_tool_parser(args.tool_parser, template)
        reasoning_parser = resolve_reasoning_parser(args.reasoning_parser, template)
    except (OSError, ValueError, UnknownParserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.stream_chunk is not None and args.stream_chunk < 1:
        print("error: --stream-chunk must be at least 1", file=sys.stderr)
        return 2
    numbers = itertools.count()
    parser = OutputParser(
        tool_parser,
        reasoning_parser,
        tools,
        args.thinking_in_prompt,
        not args.no_parallel_tool_calls,
        call_id_factory=lambda: f"call_{next(numbers):024x}",
        streaming=False,  # the non-streamed reply: a call that never closed stays content
    )
    step = args.stream_chunk or max(len(text), 1)
    deltas: list[ParsedDelta] = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)]
    deltas.append(parser.finish())
    print(json.dumps(_message(deltas, parser, args.finish_reason), ensure_ascii=False, indent=2))
    for problem in parser.problems:
        print(f"note: {problem}", file=sys.stderr)
    return 0


def _message(deltas: list[ParsedDelta], parser: OutputParser, engine_finish_reason: str) -> dict:
    out = assemble(deltas)
    return {
        "content": out.content,
        "reasoning_content": out.reasoning,
        "tool_calls": [call.to_openai() for call in out.tool_calls],
        "finish_reason": parser.finish_reason(engine_finish_reason),
    }


def _read_input(path: Path | None) -> str:
    # Bytes decoded as UTF-8 whatever the locale: model output is UTF-8.
    data = path.read_bytes() if path is not None else sys.stdin.buffer.read()
    return data.decode("utf-8")


def _read_tools(path: Path | None) -> list[dict] | None:
    if path is None:
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict):
        data = data.get("tools")
    if not isinstance(data, list) or not all(isinstance(t, dict) for t in data):
        raise ValueError(f"{path}: expected a JSON list of tools or an object with a `tools` list")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fp4serve parse-output",
        description="Parse a saved model output as the server would (tool calls, reasoning).",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
