"""/v1/completions's shapes (`CompletionEncoder`, an api/pipeline.py Encoder): prompts as text or
token ids, each prompt with its own `n` choices (choice index = prompt index * n + sample index),
as `text_completion` chunks (one per engine output), the usage chunk and `[DONE]`, or one body;
`echo` and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from api.openai.shared import CompletionLogprobs, merge_completion_logprobs
from api.openai.stream import OpenAIStream
from api.pipeline import ChoiceDelta, Started
from api.request.models import CompletionRequestModel
from api.transport.sse import encode_event
from engine.front import RequestOutput, TokenLogprob

if TYPE_CHECKING:
    from engine.front import InputProcessor

OBJECT = "text_completion"


@dataclass(frozen=True)
class EchoedPrompt:
    """What `echo` shows of one prompt."""

    text: str  # as sent, or decoded from token ids
    first_token: str  # the text of its first token: the logprobs entry that has no logprob


class CompletionEncoder(OpenAIStream):
    """/v1/completions's shapes (an api/pipeline.py Encoder)."""

    def __init__(self, started: Started, request: CompletionRequestModel, echoed: list[EchoedPrompt] | None) -> None:
        super().__init__(started.header, OBJECT, request.include_usage)
        self.request = request
        self.prompt_token_ids = started.prompts
        self.echoed = echoed  # one per prompt, with `echo`
        self.num_choices = len(started.choices)
        self.n = started.choices.n
        self._counters = [CompletionLogprobs() for _ in range(self.num_choices)]
        self._started = [False] * self.num_choices
        # Not streamed: each choice's texts, token ids, logprobs chunks, prompt logprobs and finish.
        self._texts: list[list[str]] = [[] for _ in range(self.num_choices)]
        self._token_ids: list[list[int]] = [[] for _ in range(self.num_choices)]
        self._logprob_parts: list[list[dict[str, Any]]] = [[] for _ in range(self.num_choices)]
        self._scored: dict[int, list[dict[str, Any] | None] | None] = {}
        self._finish: dict[int, tuple[str, int | str | None]] = {}

    def start(self) -> list[bytes]:
        return []

    def add(self, delta: ChoiceDelta) -> list[bytes]:
        req, index, prompt_index = self.request, delta.index, delta.prompt_index
        out = self._shown(delta.out)
        self.usage.add(prompt_index, index, out)
        first = not self._started[index]
        final = out.finish_reason is not None
        if req.streaming and not (
            out.text_delta or final or out.logprobs or req.return_token_ids or first and req.echo
        ):
            return []  # nothing to say yet
        self._started[index] = True
        if not req.streaming:
            self._keep(index, prompt_index, out, first)
            return []
        entry: dict[str, Any] = {
            "index": index,
            "text": self._echo_text(prompt_index, first) + out.text_delta,
            "logprobs": self._logprobs(index, prompt_index, out, first),
            "finish_reason": out.finish_reason,
        }
        if first and req.prompt_logprobs is not None:
            entry["prompt_logprobs"] = prompt_logprobs_entries(out.prompt_logprobs, req.prompt_logprobs)
        if final and out.stop_reason is not None:
            entry["stop_reason"] = out.stop_reason
        if req.return_token_ids:
            entry["token_ids"] = list(out.new_token_ids)
            if first:  # each choice's first chunk names its prompt
                entry["prompt_token_ids"] = self.prompt_token_ids[prompt_index]
        return [encode_event({**self._base, "choices": [entry]})]

    def body(self) -> dict[str, Any]:
        req = self.request
        choices = []
        for index in range(self.num_choices):
            reason, stop_reason = self._finish.get(index, ("abort", None))
            entry: dict[str, Any] = {
                "index": index,
                "text": "".join(self._texts[index]),
                "logprobs": merge_completion_logprobs(self._logprob_parts[index]) if req.logprobs is not None else None,
                "finish_reason": reason,
                "stop_reason": stop_reason,
            }
            if req.return_token_ids:
                entry["prompt_token_ids"] = self.prompt_token_ids[index // self.n]
                entry["token_ids"] = self._token_ids[index]
            if req.prompt_logprobs is not None:
                entry["prompt_logprobs"] = self._scored.get(index)
            choices.append(entry)
        return {**self.header.fields(OBJECT), "choices": choices, "usage": self.usage.usage()}

    def _keep(self, index: int, prompt_index: int, out: RequestOutput, first: bool) -> None:
        self._texts[index].append(self._echo_text(prompt_index, first) + out.text_delta)
        self._token_ids[index].extend(out.new_token_ids)
        part = self._logprobs(index, prompt_index, out, first)
        if part is not None:
            self._logprob_parts[index].append(part)
        if first and self.request.prompt_logprobs is not None:
            self._scored[index] = prompt_logprobs_entries(out.prompt_logprobs, self.request.prompt_logprobs)
        if out.finish_reason is not None:
            self._finish[index] = (out.finish_reason, out.stop_reason)

    def _shown(self, out: RequestOutput) -> RequestOutput:
        """With max_tokens 0 the one token the engine ran is not shown nor counted."""
        if not self.request.prompt_only:
            return out
        return replace(
            out,
            new_token_ids=(),
            text_delta="",
            logprobs=None,
            num_output_tokens=0,
            finish_reason=out.finish_reason and "length",
            stop_reason=None,
        )

    def _echo_text(self, prompt_index: int, first: bool) -> str:
        return self.echoed[prompt_index].text if first and self.echoed is not None else ""

    def _logprobs(self, index: int, prompt_index: int, out: RequestOutput, first: bool) -> dict[str, Any] | None:
        """The choice's logprobs chunk; with echo, the first one starts with the prompt's."""
        if self.request.logprobs is None:
            return None
        counter = self._counters[index]
        parts = []
        if first and self.echoed is not None and out.prompt_logprobs is not None:
            parts.append(
                counter.prompt_chunk(
                    self.echoed[prompt_index].first_token, out.prompt_logprobs[1:], self.request.logprobs
                )
            )
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
