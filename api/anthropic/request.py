"""POST /v1/messages requests (Anthropic's Messages API): the typed model of the fields we serve,
and its mapping onto the chat request the pipeline runs (`to_chat_request`): `system`, content
blocks (text, tool_use, tool_result, thinking), `system` messages inside `messages` (Claude Code
sends them for non-Claude models; engine/front/chat_messages.py folds them into the system prompt where
the template takes a system message only first), `tools`, `tool_choice` and `thinking` become
chat's normalised messages, tools and template switches, each checked here under Anthropic's own
parameter names, once.

Thinking follows Anthropic's semantics: absent or `disabled` is off (the template is rendered with
enable_thinking=false), `enabled` is on, `adaptive` leaves it to the model (the template's own
default)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from api.errors import bad_request
from api.request.messages import function_tool, parse_tool_choice, tool_call
from api.request.models import ChatCompletionRequest
from api.request.validation import Bool, Int, Number, Str, ToolsRequest, stop_limit


class MessagesRequestModel(ToolsRequest):
    messages: Any = None
    system: Any = None
    max_tokens: Int | None = Field(None, ge=1)  # required by create (the route checks), not count_tokens
    stop_sequences: list[Str] | None = None
    temperature: Number | None = Field(None, ge=0.0, le=1.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0)
    stream: Bool | None = None
    tool_choice: Any = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stop_limit(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        return stop_limit(value, "stop_sequences", info)

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means."""
        tools = _tools(self.tools) if self.tools is not None else None
        tool_choice, parallel = _tool_choice(self.tool_choice) if self.tool_choice is not None else (None, None)
        thinking = _thinking(self.thinking)
        return ChatCompletionRequest.mapped(
            model=self.model,
            messages=_system(self.system) + _messages(self.messages),
            tools=tools,
            tool_choice=parse_tool_choice(tool_choice, tools),
            parallel_tool_calls=parallel,
            chat_template_kwargs=None if thinking is None else {"enable_thinking": thinking},
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or None,
            stop=self.stop_sequences,
            stream=self.stream,
        )


# Anthropic's `thinking.type`s and what each means for the template's enable_thinking (None: the
# template's own default, the model's choice).
THINKING = {"enabled": True, "disabled": False, "adaptive": None}


def _thinking(raw: dict[str, Any] | None) -> bool | None:
    """enable_thinking for the template: absent means off, as in Anthropic's API."""
    if raw is None:
        return False
    kind = raw.get("type")
    if kind not in THINKING:
        raise bad_request(f"thinking.type must be one of {', '.join(THINKING)}, got {kind!r}", "thinking.type")
    return THINKING[kind]


def _system(raw: Any) -> list[dict[str, Any]]:
    if raw is None or raw == "":
        return []
    return [{"role": "system", "content": _texts(raw, "system")}]


def _texts(blocks: Any, param: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{param} must be a string or an array of text blocks", param)
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{param}[{j}] must be a text block: this server takes text only", f"{param}[{j}]")
        texts.append(block["text"])
    return "".join(texts)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array of message objects", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise bad_request(f"{param}.role must be user, assistant or system", f"{param}.role")
        role, content = message["role"], message.get("content")
        if role == "system":
            text = _system_message(content, i)
            if text:  # an empty one (Claude Code sends `content: []` with output_config) says nothing
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{param}.content must be a string or an array of content blocks", f"{param}.content")
        if role == "user":
            out.extend(_user_blocks(content, f"{param}.content"))
        else:
            out.append(_assistant_blocks(content, f"{param}.content"))
    return out


def _system_message(content: Any, index: int) -> str:
    """A mid-conversation system message's text. Anything but text is refused in words Claude Code
    recognises ("not supported" with `role "system"`, as Anthropic's own `role 'system' is not
    supported on this model`), so that it resends the conversation without its system messages."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f'messages.{index}.content: role "system" is not supported with this content; '
            'text-only role "system" messages take a string or an array of text blocks',
            f"messages[{index}].content",
        )
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad_request(
                f'messages.{index}.content.{j}: role "system" is not supported with {kind!r} blocks; '
                'text-only role "system" messages take text blocks',
                f"messages[{index}].content[{j}].type",
            )
        texts.append(block["text"])
    return "".join(texts)


def _user_blocks(blocks: list[Any], param: str) -> list[dict[str, Any]]:
    """Tool results become `tool` messages (first, as they answer the previous turn's calls);
    text blocks one user message."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            content = block.get("content")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": "" if content is None else _texts(content, f"{param}[{j}].content"),
                }
            )
        else:
            raise bad_request(f"{param}[{j}]: block type {kind!r} is not supported here", f"{param}[{j}].type")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _assistant_blocks(blocks: list[Any], param: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            message["content"] += block["text"]
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            if block["thinking"]:
                message["reasoning_content"] = block["thinking"]  # Qwen3 templates read this name
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str):
            call = tool_call(block["id"], block["name"], block.get("input") or {}, f"{param}[{j}].input")
            message.setdefault("tool_calls", []).append(call)
        else:
            raise bad_request(f"{param}[{j}]: block type {kind!r} is not supported here", f"{param}[{j}].type")
    return message


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if not isinstance(raw, list):
        raise bad_request("tools must be an array of tool objects", "tools")
    tools = []
    for i, tool in enumerate(raw):
        if (
            not isinstance(tool, dict)
            or not isinstance(tool.get("name"), str)
            or tool.get("type") not in (None, "custom")
        ):
            raise bad_request(f"tools[{i}] must be a custom tool with a name and an input_schema", f"tools[{i}]")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        tools.append(function_tool(function, f"tools[{i}].name", f"tools[{i}].input_schema"))
    return tools or None


def _tool_choice(raw: Any) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as chat's, and parallel_tool_calls from disable_parallel_tool_use."""
    if not isinstance(raw, dict):
        raise bad_request("tool_choice must be an object with a type", "tool_choice")
    parallel = None if raw.get("disable_parallel_tool_use") is None else not raw["disable_parallel_tool_use"]
    kind = raw.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": raw.get("name")}}, parallel
    raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type")
