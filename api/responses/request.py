"""POST /v1/responses requests (OpenAI's Responses API): the typed model of the fields we serve,
and its mapping onto the chat request the pipeline runs (`to_chat_request`): `input` items,
`instructions`, `tools`, `tool_choice`, `text.format` and `reasoning.effort` become chat's
normalised messages, tools, response format and template switches, each checked here under the
Responses API's own parameter names, once. A new API is a new set of models and a mapping, not a
new pipeline (api/pipeline.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from api.errors import bad_request
from api.grammars.response_format import parse_response_format, refuse_with_tool_choice
from api.request.messages import parse_tool_choice, tool_call
from api.request.models import ChatCompletionRequest
from api.request.validation import Bool, Int, Number, Str, ToolsRequest, check_depth
from api.responses.tools import ResponsesTools

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

    def parsed_tools(self) -> ResponsesTools:
        """The functions the model sees (namespaces flattened), and the hosted tools it does not."""
        return ResponsesTools.parse(self.tools)

    def to_chat_request(
        self, history: list[dict[str, Any]], tools: ResponsesTools | None = None
    ) -> ChatCompletionRequest:
        """The chat request this one means; `history`: the messages of the `previous_response_id`
        chain (stored in chat's normalised shape), or []; `tools`: `parsed_tools()`, if done."""
        tools = self.parsed_tools() if tools is None else tools
        for name in ("metadata", "reasoning", "text"):  # echoed in the response body, which is serialized
            check_depth(getattr(self, name), name)
        messages = list(history)
        if self.instructions:
            # NOTE: as OpenAI does, instructions apply to this turn only: they are not carried
            # into the stored history, and they lead the prompt.
            messages.insert(0, {"role": "system", "content": self.instructions})
        messages.extend(input_messages(self.input, tools))
        tool_choice = parse_tool_choice(tools.tool_choice(self.tool_choice), tools.tools)
        response_format = parse_response_format(_text_format(self.text))
        refuse_with_tool_choice(response_format, tool_choice)
        effort = (self.reasoning or {}).get("effort")
        return ChatCompletionRequest.mapped(
            model=self.model,
            messages=messages,
            tools=tools.tools,
            tool_choice=tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format,
            chat_template_kwargs=_thinking(effort),
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
        )


def _thinking(effort: Any) -> dict[str, Any] | None:
    """`reasoning.effort` as the template's enable_thinking: none / minimal turn thinking off, any
    other effort asks for it; absent leaves the template's default (but a forced call turns it
    off: api/request/models.py)."""
    if effort is None:
        return None
    return {"enable_thinking": effort not in ("none", "minimal")}


def input_messages(raw: Any, tools: ResponsesTools | None = None) -> list[dict[str, Any]]:
    """`input` (a string, or a list of message / function_call / function_call_output /
    reasoning items) as chat messages; a system or developer message may stand anywhere (the
    input processor folds it into the system prompt where the template needs). A replayed call
    to a namespaced function gets the name the model saw (`tools`)."""
    tools = tools or ResponsesTools(None)
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
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text(item.get("content"), f"{param}.content"),
                }
            )
        elif kind == "function_call":
            namespace = item.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise bad_request(f"{param}.namespace must be a string", f"{param}.namespace")
            name = tools.visible_name(_string(item, "name", param), namespace)
            call = tool_call(
                _string(item, "call_id", param), name, _string(item, "arguments", param), f"{param}.arguments"
            )
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", param),
                    "content": _text(item.get("output"), f"{param}.output"),
                }
            )
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
        if (
            not isinstance(part, dict)
            or part.get("type") not in TEXT_PART_TYPES
            or not isinstance(part.get("text"), str)
        ):
            raise bad_request(
                f"{param}[{j}] must be a text part (input_text or output_text): this server takes text only",
                f"{param}[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (api/grammars/response_format.py checks it)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}
