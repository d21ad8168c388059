"""POST /v1/responses requests (OpenAI's Responses API): the typed model of the fields we serve,
and its mapping onto the chat request the pipeline runs (`to_chat_request`): `input` items,
`instructions`, `tools`, `tool_choice`, `text.format` and `reasoning.effort` become chat's
normalised messages, tools, response format and template switches, each checked here under the
Responses API's own parameter names, once. A new API is a new set of models and a mapping, not a
new pipeline (api/pipeline.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from api.errors import bad_request
from api.messages import function_tool, parse_tool_choice, tool_call
from api.models import ChatCompletionRequest
from api.response_format import parse_response_format, refuse_with_tool_choice
from api.validation import Bool, Int, Number, Str, ToolsRequest, output_cap

TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
ROLES = ("system", "developer", "user", "assistant")


class ResponsesRequestModel(ToolsRequest):
    input: Any = None
    instructions: Str | None = None
    tool_choice: Any = None
    parallel_tool_calls: Bool | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: Bool | None = None
    store: Bool | None = None
    previous_response_id: Str | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("max_output_tokens")
    @classmethod
    def _max_output_tokens_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return output_cap(value, "max_output_tokens", info)

    def to_chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one means; `history`: the messages of the `previous_response_id`
        chain (stored in chat's normalised shape), or []."""
        messages = list(history)
        if self.instructions:
            # NOTE: as OpenAI does, instructions apply to this turn only: they are not carried
            # into the stored history, and they lead the prompt.
            messages.insert(0, {"role": "system", "content": self.instructions})
        messages.extend(input_messages(self.input))
        tools = _tools(self.tools) if self.tools is not None else None
        tool_choice = parse_tool_choice(_tool_choice(self.tool_choice), tools)
        response_format = parse_response_format(_text_format(self.text))
        refuse_with_tool_choice(response_format, tool_choice)
        effort = (self.reasoning or {}).get("effort")
        return ChatCompletionRequest.mapped(
            model=self.model,
            messages=messages,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format,
            chat_template_kwargs={"enable_thinking": False} if effort in ("none", "minimal") else None,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
        )


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """`input` (a string, or a list of message / function_call / function_call_output /
    reasoning items) as chat messages."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must be a string or a non-empty array of input items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{param}.role")
            # `developer` is the newer name for the system role; templates know only `system`.
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = tool_call(_string(item, "call_id", param), _string(item, "name", param),
                             _string(item, "arguments", param))
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({
                "role": "tool",
                "tool_call_id": _string(item, "call_id", param),
                "content": _text(item.get("output"), f"{param}.output"),
            })
        elif kind == "reasoning":
            continue  # the template drops past turns' reasoning anyway
        else:
            raise bad_request(f"{param}.type {kind!r} is not supported by this server", f"{param}.type")
    return messages


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{key} must be a string", f"{param}.{key}")
    return value


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or an array of text parts", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{j}] must be a text part (input_text or output_text): this server takes text only",
                              f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Responses tools are flat (`{"type": "function", "name", "parameters"}`); chat nests them.
    Built-in tools (web_search, file_search, custom grammar tools, ...) are left out: this
    server runs none of them, and agents such as Codex offer them beside their functions."""
    if not isinstance(raw, list):
        raise bad_request("tools must be an array of tool objects", "tools")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise bad_request(f"tools[{i}] must be an object with a type", f"tools[{i}]")
        if tool["type"] != "function":
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        tools.append(function_tool(function, f"tools[{i}].name", f"tools[{i}].parameters"))
    return tools or None


def _tool_choice(raw: Any) -> Any:
    if isinstance(raw, dict) and raw.get("type") == "function" and "function" not in raw:
        return {"type": "function", "function": {"name": raw.get("name")}}
    return raw


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (api/response_format.py checks it)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}
