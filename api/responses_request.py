"""POST /v1/responses requests (OpenAI's Responses API) as a chat request: the typed model of
the fields we serve, and the mapping of `input` items, `instructions`, `tools`, `tool_choice`
and `text.format` onto the chat body that api/protocol.py already validates. A new API is a new
set of models and a mapping, not a new pipeline."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from api.errors import bad_request
from api.models import Bool, Int, Number, Request, Str, validate

TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class ResponsesRequestModel(Request):
    input: Any = None
    instructions: Str | None = None
    tools: Any = None
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


def parse_responses_request(body: dict[str, Any]) -> ResponsesRequestModel:
    return validate(ResponsesRequestModel, body)


def chat_body(m: ResponsesRequestModel, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The /v1/chat/completions body this request means; `history`: the messages of the
    `previous_response_id` chain (already in chat shape), or []."""
    messages = list(history)
    if m.instructions:
        # NOTE: as OpenAI does, instructions apply to this turn only: they are not carried
        # into the stored history, and they lead the prompt.
        messages.insert(0, {"role": "system", "content": m.instructions})
    messages.extend(input_messages(m.input))
    body: dict[str, Any] = {"model": m.model, "messages": messages, "stream": bool(m.stream)}
    for name, value in (("max_tokens", m.max_output_tokens), ("temperature", m.temperature), ("top_p", m.top_p),
                        ("parallel_tool_calls", m.parallel_tool_calls)):
        if value is not None:
            body[name] = value
    if m.tools is not None:
        body["tools"] = _tools(m.tools)
    if m.tool_choice is not None:
        body["tool_choice"] = _tool_choice(m.tool_choice)
    response_format = _text_format(m.text)
    if response_format is not None:
        body["response_format"] = response_format
    effort = (m.reasoning or {}).get("effort")
    if effort in ("none", "minimal"):
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


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
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", param),
                "type": "function",
                "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({
                "role": "tool",
                "tool_call_id": _string(item, "call_id", param),
                "content": _text(output, f"{param}.output"),
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


def _tools(raw: Any) -> Any:
    """Responses tools are flat (`{"type": "function", "name", "parameters"}`); chat nests them.
    Built-in tools (web_search, file_search, custom grammar tools, ...) are left out: this
    server runs none of them, and agents such as Codex offer them beside their functions."""
    if not isinstance(raw, list):
        return raw  # api/messages.py answers with the error
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise bad_request(f"tools[{i}] must be an object with a type", f"tools[{i}]")
        if tool["type"] != "function":
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(raw: Any) -> Any:
    if isinstance(raw, dict) and raw.get("type") == "function" and "function" not in raw:
        return {"type": "function", "function": {"name": raw.get("name")}}
    return raw


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}
