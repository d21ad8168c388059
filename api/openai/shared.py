"""Response pieces shared by chat and completions: usage, token counting across the n samples, and
logprobs in the chat and the legacy completions shapes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.front import RequestOutput, TokenLogprob


class UsageCounter:
    """Token counts for the usage block: prompts counted once each, outputs per choice."""

    def __init__(self) -> None:
        self._prompt: dict[int, int] = {}  # prompt index -> tokens
        self._cached: dict[int, int] = {}
        self._completion: dict[int, int] = {}  # choice index -> tokens so far

    def add(self, prompt_index: int, choice_index: int, out: RequestOutput) -> None:
        self._prompt[prompt_index] = out.num_prompt_tokens
        self._cached[prompt_index] = max(self._cached.get(prompt_index, 0), out.num_cached_tokens)
        self._completion[choice_index] = out.num_output_tokens  # cumulative per sample

    def usage(self) -> dict[str, Any]:
        prompt = sum(self._prompt.values())
        completion = sum(self._completion.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self._cached.values())},
        }


def chat_logprobs(logprobs: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    """Entries of a chat choice's `logprobs.content`."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": list(lp.bytes),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in lp.top],
        }
        for lp in logprobs
    ]


class CompletionLogprobs:
    """The legacy completions `logprobs` object of one choice; `text_offset` needs a running
    character count, kept here so each chunk costs only its own tokens."""

    def __init__(self) -> None:
        self._offset = 0

    def chunk(self, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        offsets = []
        for lp in logprobs:
            offsets.append(self._offset)
            self._offset += len(lp.token)
        return {
            "tokens": [lp.token for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def prompt_chunk(self, first_token: str, logprobs: tuple[TokenLogprob | None, ...], num_top: int) -> dict[str, Any]:
        """With echo: the prompt's tokens, the first with no logprob (nothing scores it)."""
        head = {
            "tokens": [first_token],
            "token_logprobs": [None],
            "top_logprobs": [None],
            "text_offset": [self._offset],
        }
        self._offset += len(first_token)
        scored = tuple(replace(lp, top=lp.top[:num_top]) for lp in logprobs if lp is not None)
        return merge_completion_logprobs([head, self.chunk(scored)])


def merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in merged.items():
            values.extend(part[key])
    return merged
