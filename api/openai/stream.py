"""What an OpenAI chat and a legacy completions stream share: the chunk's base fields (with `usage: null`
on every chunk when the client asked for usage), the usage chunk at the end, the error event and the
`[DONE]` sentinel. Each encoder adds its own choices on top (api/openai/chat.py, api/openai/completions.py)."""

from __future__ import annotations

from typing import Any

from api.engine_stream import EngineFailed
from api.errors import APIError
from api.openai.shared import UsageCounter
from api.pipeline import ResponseHeader
from api.transport.sse import DONE, encode_error_event, encode_event


class OpenAIStream:
    """The shared half of an api/pipeline.py Encoder for the two OpenAI shapes."""

    def __init__(self, header: ResponseHeader, chunk_object: str, include_usage: bool) -> None:
        self.header = header
        self.include_usage = include_usage
        self.usage = UsageCounter()
        self._base: dict[str, Any] = header.fields(chunk_object)
        if include_usage:
            self._base["usage"] = None  # OpenAI sends usage: null on every chunk but the last

    def end(self) -> list[bytes]:
        if not self.include_usage:
            return []
        return [encode_event({**self._base, "choices": [], "usage": self.usage.usage()})]

    def error(self, error: APIError) -> list[bytes]:
        if isinstance(error, EngineFailed):  # in the engine's own words, as these streams always had them
            return [encode_error_event(error.reason)]
        return [encode_error_event(error.message, error.type, error.code)]

    def done(self) -> list[bytes]:
        return [DONE]
