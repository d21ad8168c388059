"""What the front hands api/: the per-request stream items (`RequestOutput`) with their logprobs as
text. Frozen dataclasses of plain values; the core's token-id side is engine/core_types.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str  # the token's text (decoded alone)
    logprob: float
    bytes: tuple[int, ...]  # UTF-8 bytes of the token (OpenAI's `bytes`)


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one sampled token and the top alternatives at its position."""

    token_id: int
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class RequestOutput:
    """One item of a request's output stream: what one engine step produced for one sample.

    `text_delta` is what can be shown now (stop strings are held back until they can no
    longer match). The last item has `finish_reason` set ("stop" | "length" | "abort").
    """

    request_id: str
    index: int  # which of the n samples
    new_token_ids: tuple[int, ...]
    text_delta: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, for this sample
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # only in each sample's first item
    # With SamplingParams.prompt_logprobs, in each sample's first item: one per prompt token, the
    # first None (nothing scores it)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    error: str | None = None  # set when the engine failed this request
    # With `error`: the engine process holding the request was lost and a new one is starting, so
    # the same request may be sent again (api/ answers 503 + Retry-After, not 500).
    restarting: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
