"""Tool-call and reasoning parsers: streaming state machines over a sample's text deltas
(`OutputParser` chains them), whole-text parsing, and factories by name incl. `auto`."""

from api.parsers.base import (
    ParsedDelta,
    ParsedOutput,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    UnknownParserError,
    new_call_id,
)
from api.parsers.factory import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    choose_reasoning_parser,
    choose_tool_parser,
    make_reasoning_parser,
    make_tool_parser,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from api.parsers.output_parser import OutputParser, ParserSettings, assemble, parse_text, resolve_finish_reason

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "OutputParser",
    "ParsedDelta",
    "ParsedOutput",
    "ParserSettings",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "UnknownParserError",
    "assemble",
    "choose_reasoning_parser",
    "choose_tool_parser",
    "make_reasoning_parser",
    "make_tool_parser",
    "new_call_id",
    "parse_text",
    "resolve_finish_reason",
    "resolve_reasoning_parser",
    "resolve_tool_parser",
]
