"""/v1/chat/completions's shapes (`ChatEncoder`, an api/pipeline.py Encoder): streamed, the role
chunk of each choice, one `chat.completion.chunk` per engine output (content, reasoning_content,
tool_calls, logprobs, token ids), the usage chunk, `[DONE]`; or one `chat.completion` body."""

from __future__ import annotations

from typing import Any

from api.openai.shared import chat_logprobs
from api.openai.stream import OpenAIStream
from api.parsers import ParsedDelta, assemble
from api.pipeline import ChoiceDelta, Started
from api.request.models import ChatCompletionRequest
from api.transport.sse import encode_event

CHUNK = "chat.completion.chunk"


class ChatEncoder(OpenAIStream):
    def __init__(self, started: Started, chat: ChatCompletionRequest) -> None:
        super().__init__(started.header, CHUNK, chat.include_usage)
        self.chat = chat
        self.prompt_token_ids = started.prompts[0]
        self.choices = started.choices
        n = len(started.choices)
        # Not streamed: each choice's deltas, token ids, logprobs and (finish reason, stop reason).
        self._parsed: list[list[ParsedDelta]] = [[] for _ in range(n)]
        self._token_ids: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self._finish: dict[int, tuple[str, int | str | None]] = {}

    def start(self) -> list[bytes]:
        """The role first, in each choice's own chunk."""
        events = []
        for index in range(len(self.choices)):
            first: dict[str, Any] = {**self._base, "choices": [_choice(index, {"role": "assistant", "content": ""})]}
            if self.chat.return_token_ids and index == 0:
                first["prompt_token_ids"] = self.prompt_token_ids
            events.append(encode_event(first))
        return events

    def add(self, delta: ChoiceDelta) -> list[bytes]:
        out = delta.out
        self.usage.add(0, delta.index, out)
        if not self.chat.streaming:
            self._keep(delta)
            return []
        final = delta.finish_reason is not None
        fields = _delta_fields(delta.parsed)
        if not (fields or final or out.logprobs or self.chat.return_token_ids):
            return []  # e.g. a held-back stop-string prefix: nothing to say yet
        entry = _choice(delta.index, fields, delta.finish_reason)
        if out.logprobs is not None and self.chat.num_top_logprobs is not None:
            entry["logprobs"] = {"content": chat_logprobs(out.logprobs)}
        if self.chat.return_token_ids:
            entry["token_ids"] = list(out.new_token_ids)
        if final and out.stop_reason is not None:
            entry["stop_reason"] = out.stop_reason
        return [encode_event({**self._base, "choices": [entry]})]

    def body(self) -> dict[str, Any]:
        """The whole response as one `chat.completion` body."""
        choices = []
        for index in range(len(self.choices)):
            reason, stop_reason = self._finish.get(index, ("abort", None))
            entry: dict[str, Any] = {
                "index": index,
                "message": self._message(index),
                "logprobs": {"content": self._logprobs[index]} if self.chat.num_top_logprobs is not None else None,
                "finish_reason": reason,
                "stop_reason": stop_reason,
            }
            if self.chat.return_token_ids:
                entry["token_ids"] = self._token_ids[index]
            choices.append(entry)
        body: dict[str, Any] = {
            **self.header.fields("chat.completion"),
            "choices": choices,
            "usage": self.usage.usage(),
        }
        if self.chat.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body

    def _keep(self, delta: ChoiceDelta) -> None:
        out = delta.out
        self._parsed[delta.index].append(delta.parsed)
        self._token_ids[delta.index].extend(out.new_token_ids)
        if out.logprobs is not None:
            self._logprobs[delta.index].extend(chat_logprobs(out.logprobs))
        if delta.finish_reason is not None:
            self._finish[delta.index] = (delta.finish_reason, out.stop_reason)

    def _message(self, index: int) -> dict[str, Any]:
        if not self.choices.parses(index):
            return {"role": "assistant", "content": "".join(d.content for d in self._parsed[index])}
        parsed = assemble(self._parsed[index])
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        return message


def _delta_fields(parsed: ParsedDelta) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if parsed.reasoning:
        fields["reasoning_content"] = parsed.reasoning
    if parsed.content:
        fields["content"] = parsed.content
    if parsed.tool_calls:
        # id, type and name once, in each call's first delta; then only arguments (anchors §5).
        fields["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    return fields


def _choice(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
