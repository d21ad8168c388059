"""The one place user input is checked before it reaches the engine: a request's prompt (chat
messages through the checkpoint's template, or text, to token ids) and its sampling parameters
against this model (context length and max_tokens, one vocabulary size, logit_bias and stop ids,
the grammar's syntax, logprobs counts), then split into one `EngineCoreRequest` per sample. Every
refusal is a `ParamError` naming the parameter ("prompt" for the prompt itself: api/ renames it
to its protocol's field). Below this, the engine only asserts invariants. api/ reaches the
tokenizer only through here (and /tokenize, /detokenize through the engine's own tokenizer)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.core_types import EngineCoreRequest, Owner
from engine.errors import ContextLengthError
from scheduler.request import ParamError, SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

# Prompt tokens decoded to see how the chat template ended it (an open or closed think block).
PROMPT_TAIL_TOKENS = 8


def child_request_id(request_id: str, index: int) -> str:
    """The engine's id for the index-th of a request's n samples."""
    return f"{request_id}#{index}"


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int, cap: int | None) -> int:
    """The max_tokens a request runs with: as requested, or when absent the room the prompt leaves,
    or `cap` (--max-output-tokens) if that is less. ContextLengthError when the prompt leaves no
    room, or when the request asks for more than it leaves."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ContextLengthError(num_prompt_tokens, None, max_model_len)
    if requested is None:
        return room if cap is None else min(room, cap)
    if requested > room:
        raise ContextLengthError(num_prompt_tokens, requested, max_model_len)
    return requested


class InputProcessor:
    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        tokenizer: Tokenizer | None = None,
        max_output_tokens: int | None = None,
    ) -> None:
        """`vocab_size`: the model's logits width, which every user token id must fall in;
        `tokenizer`: the checkpoint's, for prompts given as text or chat messages;
        `max_output_tokens`: what an absent max_tokens is capped to (--max-output-tokens)."""
        assert vocab_size > 0 and max_model_len > 1, f"vocab {vocab_size}, max_model_len {max_model_len}"
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_output_tokens = max_output_tokens

    # ---- prompts to token ids (blocking: run them off the event loop) ------------------------------
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> list[int]:
        """Prompt ids from the checkpoint's own chat template (ParamError when it fails)."""
        assert self.tokenizer is not None, "an InputProcessor without a tokenizer takes token ids only"
        return self.tokenizer.apply_chat_template(messages, tools, add_generation_prompt, **template_kwargs)

    def encode(self, text: str) -> list[int]:
        assert self.tokenizer is not None, "an InputProcessor without a tokenizer takes token ids only"
        return self.tokenizer.encode(text)

    def prompt_tail(self, prompt_token_ids: Sequence[int]) -> str:
        """The prompt's last few tokens as text, special tokens kept: how the template ended it."""
        assert self.tokenizer is not None, "an InputProcessor without a tokenizer takes token ids only"
        return self.tokenizer.decode(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)

    def echo_text(self, prompt_token_ids: Sequence[int], sent_text: str | None) -> tuple[str, str]:
        """What `echo` shows of a prompt: its text (as sent, else decoded with special tokens kept),
        and its first token's text (the logprobs entry nothing scores)."""
        assert self.tokenizer is not None, "an InputProcessor without a tokenizer takes token ids only"
        first_token = self.tokenizer.token_text(prompt_token_ids[0])[0]
        if sent_text is not None:
            return sent_text, first_token
        return self.tokenizer.decode(list(prompt_token_ids), skip_special_tokens=False), first_token

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> SamplingParams:
        """The parameters this request runs with (max_tokens resolved); ParamError naming the
        parameter for anything this model cannot run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ParamError("a prompt encodes to no tokens", "prompt")
        params = replace(params, max_tokens=resolve_max_tokens(params.max_tokens, n, self.max_model_len,
                                                                self.max_output_tokens))
        if params.grammar is not None:
            from engine.structured import StructuredOutputs  # xgrammar: only for constrained requests

            StructuredOutputs.check(params.grammar)
        for name, num_top in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if num_top is not None and num_top > self.vocab_size:
                raise ParamError(f"{name} {num_top} is more than the vocabulary's {self.vocab_size} tokens", name)
        self._check_ids("prompt", prompt_token_ids)
        self._check_ids("logit_bias", [token_id for token_id, _ in params.logit_bias])
        self._check_ids("stop_token_ids", params.stop_token_ids)
        return params

    def process(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        owner: Owner = Owner(),
    ) -> list[EngineCoreRequest]:
        """Validate, then one engine request per sample (seed + index for the i-th of n, as vLLM)."""
        params = self.validate(prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        prompt = tuple(prompt_token_ids)
        return [
            EngineCoreRequest(
                request_id=child_request_id(request_id, i),
                prompt_token_ids=prompt,
                params=params.for_sample(i) if params.n > 1 else params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                owner=owner,
            )
            for i in range(params.n)
        ]

    def _check_ids(self, param: str, token_ids: Sequence[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            what = "token id" if param == "prompt" else f"{param} token id"
            raise ParamError(f"{what} {bad} is out of range for a vocabulary of {self.vocab_size}", param)
