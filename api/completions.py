"""/v1/completions on top of the engine's outputs: prompts as text or token ids, each prompt
with its own `n` choices (choice index = prompt index * n + sample index), as SSE chunks
(one per engine output) or one JSON body."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from api.errors import APIError
from api.generation import Outputs
from api.protocol import CompletionRequest
from api.responses import CompletionLogprobs, ResponseHeader, UsageCounter, merge_completion_logprobs
from api.sse import DONE, encode_error_event, encode_event
from engine.outputs import RequestOutput, TokenLogprob

if TYPE_CHECKING:
    from engine.input_processor import InputProcessor

logger = logging.getLogger("fp4serve.api")

OBJECT = "text_completion"


@dataclass(frozen=True)
class EchoedPrompt:
    """What `echo` shows of one prompt."""

    text: str  # as sent, or decoded from token ids
    first_token: str  # the text of its first token: the logprobs entry that has no logprob


@dataclass(frozen=True)
class CompletionResponder:
    header: ResponseHeader
    request: CompletionRequest
    prompt_token_ids: list[list[int]]
    echoed: list[EchoedPrompt] | None = None  # one per prompt, with `echo`

    @property
    def num_choices(self) -> int:
        return len(self.prompt_token_ids) * self.request.params.n

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.request.params.n + sample_index

    async def stream(self, outputs: Outputs) -> AsyncIterator[bytes]:
        req = self.request
        base = self.header.fields(OBJECT)
        if req.stream.include_usage:
            base["usage"] = None
        usage = UsageCounter()
        logprobs = [CompletionLogprobs() for _ in range(self.num_choices)]
        started = [False] * self.num_choices
        try:
            async with aclosing(outputs):
                async for prompt_index, out in outputs:
                    if out.error is not None:
                        yield encode_error_event(out.error)
                        break
                    index = self.choice_index(prompt_index, out.index)
                    out = self._shown(out)
                    usage.add(prompt_index, index, out)
                    final = out.finish_reason is not None
                    first = not started[index]
                    if not (out.text_delta or final or out.logprobs or req.return_token_ids or first and req.echo):
                        continue
                    entry: dict[str, Any] = {
                        "index": index,
                        "text": self._echo_text(prompt_index, first) + out.text_delta,
                        "logprobs": self._logprobs(logprobs[index], prompt_index, out, first),
                        "finish_reason": out.finish_reason,
                    }
                    if first and req.prompt_logprobs is not None:
                        entry["prompt_logprobs"] = prompt_logprobs_entries(out.prompt_logprobs, req.prompt_logprobs)
                    if final and out.stop_reason is not None:
                        entry["stop_reason"] = out.stop_reason
                    if req.return_token_ids:
                        entry["token_ids"] = list(out.new_token_ids)
                        if not started[index]:  # each choice's first chunk names its prompt
                            entry["prompt_token_ids"] = self.prompt_token_ids[prompt_index]
                    started[index] = True
                    yield encode_event({**base, "choices": [entry]})
                else:
                    if req.stream.include_usage:
                        yield encode_event({**base, "choices": [], "usage": usage.usage()})
        except asyncio.CancelledError:
            raise
        except APIError as e:  # its deadline: --request-timeout, or a shutdown that stopped waiting
            yield encode_error_event(e.message, e.type, e.code)
        except Exception:
            logger.exception("completion stream %s failed", self.header.id)
            yield encode_error_event("generation failed; see the server log")
        yield DONE

    async def complete(self, outputs: Outputs) -> dict[str, Any]:
        req = self.request
        usage = UsageCounter()
        texts: list[list[str]] = [[] for _ in range(self.num_choices)]
        token_ids: list[list[int]] = [[] for _ in range(self.num_choices)]
        logprob_parts: list[list[dict[str, Any]]] = [[] for _ in range(self.num_choices)]
        logprobs = [CompletionLogprobs() for _ in range(self.num_choices)]
        finish: dict[int, tuple[str, int | str | None]] = {}
        scored: dict[int, list[dict[str, Any] | None]] = {}
        async with aclosing(outputs):
            async for prompt_index, out in outputs:
                if out.error is not None:
                    raise APIError(500, f"generation failed: {out.error}", code="engine_error")
                index = self.choice_index(prompt_index, out.index)
                out = self._shown(out)
                usage.add(prompt_index, index, out)
                first = not texts[index]
                texts[index].append(self._echo_text(prompt_index, first) + out.text_delta)
                token_ids[index].extend(out.new_token_ids)
                part = self._logprobs(logprobs[index], prompt_index, out, first)
                if part is not None:
                    logprob_parts[index].append(part)
                if first and req.prompt_logprobs is not None:
                    scored[index] = prompt_logprobs_entries(out.prompt_logprobs, req.prompt_logprobs)
                if out.finish_reason is not None:
                    finish[index] = (out.finish_reason, out.stop_reason)
        choices = []
        for index in range(self.num_choices):
            reason, stop_reason = finish.get(index, ("abort", None))
            entry: dict[str, Any] = {
                "index": index,
                "text": "".join(texts[index]),
                "logprobs": merge_completion_logprobs(logprob_parts[index]) if req.logprobs is not None else None,
                "finish_reason": reason,
                "stop_reason": stop_reason,
            }
            if req.return_token_ids:
                entry["prompt_token_ids"] = self.prompt_token_ids[index // req.params.n]
                entry["token_ids"] = token_ids[index]
            if req.prompt_logprobs is not None:
                entry["prompt_logprobs"] = scored.get(index)
            choices.append(entry)
        return {**self.header.fields(OBJECT), "choices": choices, "usage": usage.usage()}

    def _shown(self, out: RequestOutput) -> RequestOutput:
        """With max_tokens 0 the one token the engine ran is not shown nor counted."""
        if not self.request.prompt_only:
            return out
        return replace(out, new_token_ids=(), text_delta="", logprobs=None, num_output_tokens=0,
                       finish_reason=out.finish_reason and "length", stop_reason=None)

    def _echo_text(self, prompt_index: int, first: bool) -> str:
        return self.echoed[prompt_index].text if first and self.echoed is not None else ""

    def _logprobs(self, counter: CompletionLogprobs, prompt_index: int, out: RequestOutput,
                  first: bool) -> dict[str, Any] | None:
        """The choice's logprobs chunk; with echo, the first one starts with the prompt's."""
        if self.request.logprobs is None:
            return None
        parts = []
        if first and self.echoed is not None and out.prompt_logprobs is not None:
            parts.append(counter.prompt_chunk(self.echoed[prompt_index].first_token, out.prompt_logprobs[1:],
                                              self.request.logprobs))
        if out.logprobs is not None:
            parts.append(counter.chunk(out.logprobs))
        return merge_completion_logprobs(parts) if parts else None


def prompt_logprobs_entries(
    entries: tuple[TokenLogprob | None, ...] | None, num_top: int
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (the first None) {token id: {logprob, decoded_token}},
    the prompt's token and the top `num_top` alternatives (echo's logprobs may have asked the engine
    for more)."""
    if entries is None:
        return None
    shown: list[dict[str, Any] | None] = []
    for lp in entries:
        if lp is None:
            shown.append(None)
            continue
        ranked = {str(t.token_id): {"logprob": t.logprob, "decoded_token": t.token} for t in lp.top[:num_top]}
        shown.append({str(lp.token_id): {"logprob": lp.logprob, "decoded_token": lp.token}, **ranked})
    return shown


def echoed_prompt(inputs: InputProcessor, prompt: str | list[int], token_ids: list[int]) -> EchoedPrompt:
    """Blocking (run it off the loop): the prompt as sent, or decoded from its token ids."""
    return EchoedPrompt(*inputs.echo_text(token_ids, prompt if isinstance(prompt, str) else None))
