"""/v1/completions on top of the engine's outputs: prompts as text or token ids, each prompt
with its own `n` choices (choice index = prompt index * n + sample index), as SSE chunks
(one per engine output) or one JSON body."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from api.errors import APIError
from api.generation import Outputs
from api.protocol import CompletionRequest
from api.responses import CompletionLogprobs, ResponseHeader, UsageCounter, merge_completion_logprobs
from api.sse import DONE, encode_error_event, encode_event

logger = logging.getLogger("fp4serve.api")

OBJECT = "text_completion"


@dataclass(frozen=True)
class CompletionResponder:
    header: ResponseHeader
    request: CompletionRequest
    prompt_token_ids: list[list[int]]

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
                    usage.add(prompt_index, index, out)
                    final = out.finish_reason is not None
                    if not (out.text_delta or final or out.logprobs or req.return_token_ids):
                        continue
                    entry: dict[str, Any] = {
                        "index": index,
                        "text": out.text_delta,
                        "logprobs": logprobs[index].chunk(out.logprobs) if out.logprobs is not None else None,
                        "finish_reason": out.finish_reason,
                    }
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
        async with aclosing(outputs):
            async for prompt_index, out in outputs:
                if out.error is not None:
                    raise APIError(500, f"generation failed: {out.error}", code="engine_error")
                index = self.choice_index(prompt_index, out.index)
                usage.add(prompt_index, index, out)
                texts[index].append(out.text_delta)
                token_ids[index].extend(out.new_token_ids)
                if out.logprobs is not None:
                    logprob_parts[index].append(logprobs[index].chunk(out.logprobs))
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
            choices.append(entry)
        return {**self.header.fields(OBJECT), "choices": choices, "usage": usage.usage()}
