"""The one place user input is checked before it reaches the engine: a request's prompt (chat
messages through the checkpoint's template, or text, to token ids) and its sampling parameters
against this model (context length, one vocabulary size, its grammar), then split into one
`EngineCoreRequest` per sample. Below this, the engine only asserts invariants. api/ reaches the
tokenizer only through here (and /tokenize, /detokenize through the engine's own tokenizer)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.core_types import EngineCoreRequest, Owner
from scheduler.request import ParamError, SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

# Prompt tokens decoded to see how the chat template ended it (an open or closed think block).
PROMPT_TAIL_TOKENS = 8


def child_request_id(request_id: str, index: int) -> str:
    """The engine's id for the index-th of a request's n samples."""
    return f"{request_id}#{index}"


class InputProcessor:
    def __init__(
        self, vocab_size: int, max_model_len: int, eos_token_ids: Sequence[int], tokenizer: Tokenizer | None = None
    ) -> None:
        """`vocab_size`: the model's logits width, which every user token id must fall in;
        `tokenizer`: the checkpoint's, for prompts given as text or chat messages."""
        assert vocab_size > 0 and max_model_len > 1, f"vocab {vocab_size}, max_model_len {max_model_len}"
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer

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

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams, param_name: str = "prompt") -> None:
        """Raise ParamError (naming the parameter) for anything this model cannot run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ParamError("the prompt is empty", param_name)
        if n >= self.max_model_len:
            raise ParamError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has {n} tokens "
                f"(it must leave room for at least one generated token)",
                param_name,
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ParamError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion). "
                f"Reduce the prompt or max_tokens.",
                "max_tokens",
            )
        if params.grammar is not None:
            from engine.structured import StructuredOutputs  # xgrammar: only for constrained requests

            StructuredOutputs.check(params.grammar)
        for name, num_top in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if num_top is not None and num_top > self.vocab_size:
                raise ParamError(f"{name} {num_top} is more than the vocabulary's {self.vocab_size} tokens", name)
        self._check_ids(param_name, prompt_token_ids)
        self._check_ids("logit_bias", [token_id for token_id, _ in params.logit_bias])
        self._check_ids("stop_token_ids", params.stop_token_ids)

    def process(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        owner: Owner | None = None,
    ) -> list[EngineCoreRequest]:
        """Validate, then one engine request per sample (seed + index for the i-th of n, as vLLM)."""
        self.validate(prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        prompt = tuple(prompt_token_ids)
        owner = owner or Owner()
        return [
            EngineCoreRequest(
                request_id=child_request_id(request_id, i),
                prompt_token_ids=prompt,
                params=params.for_sample(i) if params.n > 1 else params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                key=owner.key,
                weight=owner.weight,
                key_priority=owner.key_priority,
                priority=owner.priority,
            )
            for i in range(params.n)
        ]

    def _check_ids(self, param: str, token_ids: Sequence[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            what = "token id" if param in ("prompt", "messages") else f"{param} token id"
            raise ParamError(f"{what} {bad} is out of range for a vocabulary of {self.vocab_size}", param)
