"""Chat messages, tools and tool_choice as the OpenAI API sends them, normalised into the
plain dicts chat templates expect (text content as one string, tool-call arguments as objects).
The other protocols build the same shapes from their own (`tool_call`, `function_tool`)."""

from __future__ import annotations

from typing import Any

import orjson

from api.errors import bad_request
from api.request.validation import check_depth

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array of message objects", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]


def _message(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise bad_request(f"{param} must be an object", param)
    role = raw.get("role")
    if role not in ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{param}.role")
    # `developer` is OpenAI's newer name for the system role; templates know only `system`.
    message: dict[str, Any] = {"role": "system" if role == "developer" else role}
    tool_calls = _tool_calls(raw.get("tool_calls"), f"{param}.tool_calls") if role == "assistant" else None
    content = _content(raw.get("content"), f"{param}.content")
    if content is None and not (role == "assistant"):
        raise bad_request(f"{param}.content is required for a {role} message", f"{param}.content")
    # NOTE: templates test `content is string` or call `| trim` on it; "" is safe for both.
    message["content"] = content or ""
    for key in ("name", "tool_call_id"):
        value = raw.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise bad_request(f"{param}.{key} must be a string", f"{param}.{key}")
            message[key] = value
    if tool_calls:
        message["tool_calls"] = tool_calls
    reasoning = raw.get("reasoning_content", raw.get("reasoning"))
    if role == "assistant" and isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning  # Qwen3 templates read this name
    return message


def _content(raw: Any, param: str) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise bad_request(f"{param} must be a string or an array of content parts", param)
    texts = []
    for j, part in enumerate(raw):
        part_param = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"{part_param} must be an object", part_param)
        kind = part.get("type")
        if kind not in ("text", "input_text"):
            raise bad_request(
                f"{part_param}.type {kind!r} is not supported: this server takes text only", f"{part_param}.type"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{part_param}.text must be a string", f"{part_param}.text")
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(raw: Any, param: str) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request(f"{param} must be an array", param)
    calls = []
    for j, call in enumerate(raw):
        call_param = f"{param}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{call_param}.function.name must be a string", f"{call_param}.function.name")
        calls.append(
            tool_call(
                call["id"] if isinstance(call.get("id"), str) else None,
                function["name"],
                function.get("arguments"),
                f"{call_param}.function.arguments",
            )
        )
    return calls


def tool_call(call_id: str | None, name: str, arguments: Any, param: str | None = None) -> dict[str, Any]:
    """One assistant tool call as templates read it; `arguments` a JSON string or an object,
    checked for depth (the template serializes it) when `param` names it in the request."""
    parsed = _arguments(arguments)
    if param is not None:
        check_depth(parsed, param)
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": parsed}}
    if call_id is not None:
        call["id"] = call_id
    return call


def _arguments(raw: Any) -> Any:
    """The API sends arguments as a JSON string; templates iterate them as an object
    (Qwen3-Coder's `arguments|items`). A string that is not a JSON object is kept as it is:
    agents replay truncated calls, and the template may still render a string."""
    if isinstance(raw, str):
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
        return parsed if isinstance(parsed, dict) else raw
    return {} if raw is None else raw


def parse_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("tools must be an array of tool objects", "tools")
    tools = []
    for i, tool in enumerate(raw):
        param = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(f'{param} must be {{"type": "function", "function": {{...}}}}', param)
        tools.append(function_tool(function, f"{param}.function.name", f"{param}.function.parameters"))
    return tools or None


def function_tool(function: dict[str, Any], name_param: str, parameters_param: str) -> dict[str, Any]:
    """A tool in chat's nested shape, `{"type": "function", "function": {name, description?,
    parameters?}}`, its name and schema checked (the params name them in the caller's protocol)."""
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request(f"{name_param} must be a non-empty string", name_param)
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{parameters_param} must be a JSON schema object", parameters_param)
    check_depth(parameters, parameters_param)
    return {"type": "function", "function": function}


def parse_tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    """Checked for shape and against `tools`. "required" and a named function are enforced while
    decoding by a grammar (api/grammars/tool_grammar.py, wired in api/routes.py)."""
    if raw is None or raw in ("none", "auto", "required"):
        if raw == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return raw
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    names = {t["function"]["name"] for t in tools or []}
    if function["name"] not in names:
        raise bad_request(f"tool_choice names function {function['name']!r}, which is not in tools", "tool_choice")
    return raw
