"""Parser names (as `--tool-parser` / `--reasoning-parser` take them) -> parser objects,
and the `auto` choice made from the model's chat template."""

from __future__ import annotations

from api.parsers.base import CallIdFactory, ReasoningParser, ToolParser, UnknownParserError, new_call_id
from api.parsers.qwen3_coder_tool import Qwen3CoderToolParser
from api.parsers.qwen3_tool import Qwen3ToolParser
from api.parsers.reasoning import Qwen3ReasoningParser

TOOL_PARSERS = ("qwen3", "qwen3_coder")
REASONING_PARSERS = ("qwen3",)
AUTO = "auto"
# Peers' names for the same formats, so that a vLLM/SGLang command line works unchanged.
_TOOL_ALIASES = {"hermes": "qwen3", "qwen25": "qwen3", "qwen3_xml": "qwen3_coder"}


def choose_tool_parser(chat_template: str | None) -> str | None:
    """The tool format a chat template teaches: Qwen3-Coder's XML if it mentions
    `<function=`/`<parameter=`, Qwen3's JSON if it mentions `<tool_call>`, else None."""
    if not chat_template:
        return None
    if "<function=" in chat_template or "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<tool_call>" in chat_template:
        return "qwen3"
    return None


def choose_reasoning_parser(chat_template: str | None) -> str | None:
    """`qwen3` when the template handles `<think>` blocks, else None."""
    return "qwen3" if chat_template and "<think>" in chat_template else None


def resolve_tool_parser(name: str | None, chat_template: str | None = None) -> str | None:
    """A `--tool-parser` value as one of TOOL_PARSERS (or None): `auto` is chosen from the
    template, peers' aliases are mapped. Raises UnknownParserError for anything else."""
    if name is None or name == "none":
        return None
    if name == AUTO:
        return choose_tool_parser(chat_template)
    name = _TOOL_ALIASES.get(name, name)
    if name not in TOOL_PARSERS:
        raise UnknownParserError("tool", name, (*TOOL_PARSERS, *_TOOL_ALIASES, AUTO, "none"))
    return name


def resolve_reasoning_parser(name: str | None, chat_template: str | None = None) -> str | None:
    if name is None or name == "none":
        return None
    if name == AUTO:
        return choose_reasoning_parser(chat_template)
    if name not in REASONING_PARSERS:
        raise UnknownParserError("reasoning", name, (*REASONING_PARSERS, AUTO, "none"))
    return name


def make_tool_parser(
    name: str,
    tools: list[dict] | None,
    call_id_factory: CallIdFactory = new_call_id,
    *,
    chat_template: str | None = None,
    streaming: bool = True,
) -> ToolParser:
    """A fresh streaming tool parser (one per sample). `auto` needs `chat_template`.
    `streaming=False` holds each call until it closes (api/parsers/tool_stream.py)."""
    resolved = resolve_tool_parser(name, chat_template)
    if resolved is None:
        raise UnknownParserError("tool", f"{name} (no tool format found in the chat template)", TOOL_PARSERS)
    if resolved == "qwen3_coder":
        return Qwen3CoderToolParser(tools, call_id_factory, streaming)
    return Qwen3ToolParser(tools, call_id_factory, streaming)


def make_reasoning_parser(name: str, starts_in_reasoning: bool, *, chat_template: str | None = None) -> ReasoningParser:
    """A fresh streaming reasoning parser (one per sample). `auto` needs `chat_template`."""
    resolved = resolve_reasoning_parser(name, chat_template)
    if resolved is None:
        raise UnknownParserError("reasoning", f"{name} (no <think> in the chat template)", REASONING_PARSERS)
    return Qwen3ReasoningParser(starts_in_reasoning)
