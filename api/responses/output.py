"""The Responses API's output (`ResponsesEncoder`, an api/pipeline.py Encoder): parsed deltas
become output items — `reasoning`, `message` (one `output_text` part), `function_call` — and,
when streaming, the events the OpenAI SDK's `responses.stream()` consumes, in its order:

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning: response.reasoning_text.delta* / .done
      message:   response.content_part.added, response.output_text.delta* / .done, response.content_part.done
      call:      response.function_call_arguments.delta* / .done
    response.output_item.done,
    response.completed, or response.incomplete (reason max_output_tokens).

A non-streamed reply runs the same builder and keeps only the items. A finished response is put
in the store (api/responses/store.py) unless the request said `store: false`."""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from api.errors import APIError
from api.parsers.base import ParsedDelta
from api.pipeline import ChoiceDelta, Started, Totals
from api.request.messages import tool_call
from api.request.models import ChatCompletionRequest
from api.responses.request import ResponsesRequestModel
from api.responses.store import ResponseStore, StoredResponse
from api.responses.tools import ResponsesTools


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class OutputItems:
    """Builds the output items from deltas; `events` collects the stream events (each a dict
    without `sequence_number`, which the encoder adds)."""

    def __init__(self, tools: ResponsesTools) -> None:
        self.tools = tools  # a call to a namespaced function goes out with its own name and `namespace`
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item deltas go to now
        self._open_call = -1  # the parser's index of the open function call
        self._call_index: dict[str, int] = {}  # function_call item id -> the parser's call index
        self._broken: set[int] = set()  # the parser's indices of calls that never closed

    def mark_broken(self, call_indices: tuple[int, ...]) -> None:
        """Calls whose text never closed (a streamed parser's `broken_calls`): their items end
        `incomplete`. Call before `add` with the deltas of the same feed."""
        self._broken.update(call_indices)

    def add(self, delta: ParsedDelta) -> None:
        if delta.reasoning:
            self._reasoning(delta.reasoning)
        if delta.content:
            self._text(delta.content)
        for call in delta.tool_calls:
            if call.is_header:
                name, namespace = self.tools.wire_name(call.name)
                item = {
                    "type": "function_call",
                    "id": new_id("fc"),
                    "call_id": call.id,
                    "name": name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._open_item(item if namespace is None else {**item, "namespace": namespace})
                self._open_call = call.index
                self._call_index[self.items[-1]["id"]] = call.index
            if call.arguments and call.index == self._open_call:
                item = self._open
                assert item is not None and item["type"] == "function_call"
                item["arguments"] += call.arguments
                self._event("response.function_call_arguments.delta", item_id=item["id"], delta=call.arguments)

    def close(self, incomplete: bool) -> None:
        """The last item is done; a call cut by max_output_tokens is `incomplete`."""
        self._close_open("incomplete" if incomplete else "completed")

    # ---- items ---------------------------------------------------------------------------------

    def _reasoning(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = self._open_item(
                {
                    "type": "reasoning",
                    "id": new_id("rs"),
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}],
                    "status": "in_progress",
                }
            )
        item["content"][0]["text"] += text
        self._event("response.reasoning_text.delta", item_id=item["id"], content_index=0, delta=text)

    def _text(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            item = self._open_item(
                {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress", "content": []}
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            self._event("response.content_part.added", item_id=item["id"], content_index=0, part=dict(part))
        item["content"][0]["text"] += text
        self._event("response.output_text.delta", item_id=item["id"], content_index=0, delta=text, logprobs=[])

    def _open_item(self, item: dict[str, Any]) -> dict[str, Any]:
        self._close_open("completed")
        self.items.append(item)
        self._open = item
        self._event("response.output_item.added", item=_copy(item))
        return item

    def _close_open(self, status: str) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        kind = item["type"]
        if kind == "function_call" and self._call_index[item["id"]] in self._broken:
            status = "incomplete"
        item["status"] = status
        if kind == "reasoning":
            text = item["content"][0]["text"]
            self._event("response.reasoning_text.done", item_id=item["id"], content_index=0, text=text)
        elif kind == "message":
            part = item["content"][0]
            self._event(
                "response.output_text.done", item_id=item["id"], content_index=0, text=part["text"], logprobs=[]
            )
            self._event("response.content_part.done", item_id=item["id"], content_index=0, part=dict(part))
        else:
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                name=item["name"],
                arguments=item["arguments"],
            )
        self._event("response.output_item.done", item=_copy(item))

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "output_index": len(self.items) - 1, **fields})


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(p) for p in copied["content"]]
    return copied


def response_body(
    response_id: str,
    model: str,
    created_at: int,
    request: Any,
    items: list[dict[str, Any]] | None,
    totals: Totals | None,
    previous_response_id: str | None,
    store: bool,
) -> dict[str, Any]:
    """The `response` object; `totals` None while it is still in progress."""
    status = "in_progress"
    incomplete = None
    if totals is not None:
        status = "completed"
        if totals.ended_as in ("length", "abort"):
            status = "incomplete"
            incomplete = {"reason": "max_output_tokens" if totals.ended_as == "length" else None}
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": model,
        "output": items or [],
        "parallel_tool_calls": request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
        "previous_response_id": previous_response_id,
        "reasoning": request.reasoning,
        "store": store,
        "temperature": request.temperature,
        "text": request.text or {"format": {"type": "text"}},
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": request.tools or [],
        "top_p": request.top_p,
        "metadata": request.metadata or {},
        "usage": None,
    }
    if totals is not None:
        body["usage"] = {
            "input_tokens": totals.prompt_tokens,
            "input_tokens_details": {"cached_tokens": totals.cached_tokens},
            "output_tokens": totals.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": totals.prompt_tokens + totals.output_tokens,
        }
    return body


def now() -> int:
    return int(time.time())


def assistant_messages(items: list[dict[str, Any]], tools: ResponsesTools) -> list[dict[str, Any]]:
    """The output items as the chat messages a later turn (`previous_response_id`) replays, in
    chat's normalised shape (api/request/messages.py), calls under the names the model saw."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            message["content"] += item["content"][0]["text"]
        elif item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "function_call":
            name = tools.visible_name(item["name"], item.get("namespace"))
            message.setdefault("tool_calls", []).append(tool_call(item["call_id"], name, item["arguments"]))
    if not message.get("reasoning_content"):
        message.pop("reasoning_content", None)
    return [message]


class ResponsesEncoder:
    """One response's events and body; the finished response goes to the store."""

    def __init__(
        self,
        started: Started,
        request: ResponsesRequestModel,
        chat: ChatCompletionRequest,
        tools: ResponsesTools,
        store: ResponseStore,
        owner: bytes,
    ) -> None:
        self.request = request
        self.chat = chat
        self.tools = tools
        self.store = store
        self.owner = owner
        self.response_id = new_id("resp")
        self.model = started.header.model
        self.created_at = now()
        self.should_store = request.store is not False
        self.items = OutputItems(tools)
        self.totals = Totals()
        self._sequence = 0

    def start(self) -> list[bytes]:
        pending = self._body(None)
        return [
            self._encode({"type": "response.created", "response": pending}),
            self._encode({"type": "response.in_progress", "response": pending}),
        ]

    def add(self, delta: ChoiceDelta) -> list[bytes]:
        self.totals.add(delta)
        self.items.mark_broken(delta.broken_calls)
        if not delta.parsed.is_empty:
            self.items.add(delta.parsed)
        return self._drain()

    def end(self) -> list[bytes]:
        final = self.body()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*self._drain(), self._encode({"type": kind, "response": final})]

    def error(self, error: APIError) -> list[bytes]:
        return [
            self._encode(
                {"type": "error", "code": error.code or "server_error", "message": error.message, "param": None}
            )
        ]

    def done(self) -> list[bytes]:
        return []

    def body(self) -> dict[str, Any]:
        """The finished response, stored unless `store: false`."""
        self.items.close(incomplete=self.totals.ended_as == "length")
        final = self._body(self.totals)
        if self.should_store:
            instructions = self.request.instructions
            own = [msg for msg in self.chat.messages if not (instructions and msg is self.chat.messages[0])]
            replay = own + assistant_messages(self.items.items, self.tools)
            self.store.put(self.response_id, StoredResponse(self.owner, final, replay))
        return final

    def _body(self, totals: Totals | None) -> dict[str, Any]:
        m = self.request
        return response_body(
            self.response_id,
            self.model,
            self.created_at,
            m,
            self.items.items if totals else [],
            totals,
            m.previous_response_id,
            self.should_store,
        )

    def _drain(self) -> list[bytes]:
        events = [self._encode(event) for event in self.items.events]
        self.items.events.clear()
        return events

    def _encode(self, event: dict[str, Any]) -> bytes:
        event = {**event, "sequence_number": self._sequence}
        self._sequence += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
