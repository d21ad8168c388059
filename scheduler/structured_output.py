"""`StructuredOutput`: what a constrained request's output must be, as typed data. The api maps a
request's response_format / tool_choice / text.format into it (and refuses bad ones with a 400
first); engine/structured_output/manager.py compiles it, and its grammar cache keys on it. Pure data: no
grammar engine here, so the scheduler and the api stay free of xgrammar and torch."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["json_object", "json_schema", "regex", "ebnf", "structural_tag", "tool_calls"]
KINDS: tuple[Kind, ...] = ("json_object", "json_schema", "regex", "ebnf", "structural_tag", "tool_calls")
ToolFormat = Literal["qwen3", "qwen3_coder"]  # the --tool-parser formats a grammar can bind
# How a Qwen3-Coder parameter's raw text is read back (api/parsers/schema_types.py decides it per
# parameter, so the grammar and the parser always agree).
XmlValueKind = Literal["text", "integer", "number", "boolean", "object", "array", "null", "enum"]


class Reasoning(str, enum.Enum):
    """Whether a think block comes before the structured part."""

    NONE = "none"  # no reasoning parser, or the prompt closed the block: the output is the format alone
    OPTIONAL = "optional"  # the output may open a think block first, and must close it
    OPEN = "open"  # the prompt left the block open: the output starts inside it and must close it


@dataclass(frozen=True)
class ThinkTags:
    """The reasoning parser's tags around a think block."""

    open: str = "<think>"
    close: str = "</think>"


THINK = ThinkTags()  # Qwen3's, the default


@dataclass(frozen=True)
class XmlParam:
    """One parameter of a Qwen3-Coder call: how its value is written, in the schema's order."""

    name: str
    kind: XmlValueKind
    nullable: bool = False


@dataclass(frozen=True)
class ToolSpec:
    """One function a call may name. `parameters`: its JSON schema as canonical JSON text ("" when
    it takes none), so that equal tool sets are equal specs; `xml_params`: for qwen3_coder."""

    name: str
    parameters: str = ""
    xml_params: tuple[XmlParam, ...] = ()

    @property
    def schema(self) -> Any:
        return json.loads(self.parameters) if self.parameters else None


@dataclass(frozen=True)
class StructuredOutput:
    """The output's required shape. Build one with the constructors below; equal specs compile to
    the same grammar (the cache's key)."""

    kind: Kind
    # json_schema: the schema as canonical JSON text; regex: the pattern; ebnf: the grammar text;
    # structural_tag: xgrammar's structural tag as JSON text.
    # Kept out of the repr: a schema or grammar runs to kilobytes.
    text: str = field(default="", repr=False)
    tools: tuple[ToolSpec, ...] = field(default=(), repr=False)  # tool_calls: the functions a call may name
    tool_format: ToolFormat | None = None  # tool_calls: how a call is written
    parallel: bool = False  # tool_calls: one or more calls (else exactly one)
    reasoning: Reasoning = Reasoning.NONE
    think: ThinkTags = THINK

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"unknown structured output kind {self.kind!r}"
        assert (self.kind in ("json_schema", "regex", "ebnf", "structural_tag")) == bool(self.text), (
            f"{self.kind} with text {self.text[:40]!r}"
        )
        assert (self.kind == "tool_calls") == bool(self.tools) == (self.tool_format is not None), (
            f"{self.kind}: tools {len(self.tools)}, format {self.tool_format}"
        )
        assert self.kind not in ("regex", "ebnf", "structural_tag") or self.reasoning is Reasoning.NONE, (
            f"{self.kind} takes no think prefix"
        )

    @staticmethod
    def json_object(reasoning: Reasoning = Reasoning.NONE, think: ThinkTags = THINK) -> StructuredOutput:
        """One JSON object and nothing else (after the think block, if any)."""
        return StructuredOutput("json_object", reasoning=reasoning, think=think)

    @staticmethod
    def json_schema(schema: Any, reasoning: Reasoning = Reasoning.NONE, think: ThinkTags = THINK) -> StructuredOutput:
        """One JSON value that fits `schema` (a dict or a boolean, already checked by the api)."""
        return StructuredOutput("json_schema", canonical_json(schema), reasoning=reasoning, think=think)

    @staticmethod
    def regex(pattern: str) -> StructuredOutput:
        return StructuredOutput("regex", pattern)

    @staticmethod
    def ebnf(grammar: str) -> StructuredOutput:
        """EBNF in xgrammar's dialect, taken as it is."""
        return StructuredOutput("ebnf", grammar)

    @staticmethod
    def structural_tag(text: str) -> StructuredOutput:
        """xgrammar's structural tag (JSON text, its current form or vLLM's older `structures` /
        `triggers` one), taken as it is: the engine turns it into a grammar."""
        return StructuredOutput("structural_tag", text)

    @staticmethod
    def tool_calls(
        tools: tuple[ToolSpec, ...],
        tool_format: ToolFormat,
        parallel: bool,
        reasoning: Reasoning = Reasoning.NONE,
        think: ThinkTags = THINK,
    ) -> StructuredOutput:
        """Tool calls only, each naming one of `tools` with arguments that fit its schema; one or
        more of them with `parallel`, else exactly one."""
        return StructuredOutput(
            "tool_calls", tools=tools, tool_format=tool_format, parallel=parallel, reasoning=reasoning, think=think
        )


def canonical_json(value: Any) -> str:
    """`value` as JSON text that is equal for equal values written in the same key order.
    NOTE: keys are not sorted: a schema's property order is the order the output follows."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
