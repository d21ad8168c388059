"""The one place user input is checked before it reaches the engine: a request's prompt (chat
messages through the checkpoint's template, or text, to token ids) and its sampling parameters
against this model (context length and max_tokens, one vocabulary size, logit_bias and stop ids,
the grammar's syntax, logprobs counts), then split into one `EngineCoreRequest` per sample. Every
refusal is a `ParamError` naming the parameter ("prompt" for the prompt itself: api/ renames it
to its protocol's field). Below this, the engine only asserts invariants. api/ reaches the
tokenizer only through here (and /tokenize, /detokenize through the engine's own tokenizer)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from engine.core_types import EngineCoreRequest, Owner
from engine.errors import ContextLengthError
from engine.front.chat_messages import fold_system_messages, template_probe
from engine.front.prompt_bound import chars_per_token_bound
from scheduler.request import ParamError, SamplingParams

if TYPE_CHECKING:
    from engine.front.tokenizer import Tokenizer

logger = logging.getLogger("fp4serve.engine")

# Prompt tokens decoded to see how the chat template ended it (an open or closed think block).
PROMPT_TAIL_TOKENS = 8
MaxTokensPolicy = Literal["clamp", "reject"]
MAX_TOKENS_POLICIES: tuple[MaxTokensPolicy, ...] = ("clamp", "reject")


def child_request_id(request_id: str, index: int) -> str:
    """The engine's id for the index-th of a request's n samples."""
    return f"{request_id}#{index}"


@dataclass(frozen=True)
class MaxTokens:
    """The max_tokens a request runs with, and what lowered it below what was asked, if anything."""

    value: int
    lowered_by: Literal["context", "cap"] | None = None


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    cap: int | None,
    policy: MaxTokensPolicy = "reject",
) -> MaxTokens:
    """The max_tokens a request runs with: at most `cap` (--max-output-tokens), and at most the room
    the prompt leaves in the context; absent, the smaller of the two. A request asking for more
    than the room is lowered to it under the "clamp" policy (its finish_reason then says `length`)
    and refused under "reject". ContextLengthError when the prompt leaves no room, or (reject)
    when the request asks for more than it leaves."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ContextLengthError(num_prompt_tokens, None, max_model_len)
    limit = room if cap is None else min(room, cap)
    if requested is None:
        return MaxTokens(limit)
    if requested > room and policy == "reject":
        raise ContextLengthError(num_prompt_tokens, requested, max_model_len)
    if requested <= limit:
        return MaxTokens(requested)
    return MaxTokens(limit, "context" if limit == room else "cap")


class InputProcessor:
    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        tokenizer: Tokenizer | None = None,
        max_output_tokens: int | None = None,
        max_tokens_policy: MaxTokensPolicy = "clamp",
    ) -> None:
        """`vocab_size`: the model's logits width, which every user token id must fall in;
        `tokenizer`: the checkpoint's, for prompts given as text or chat messages;
        `max_output_tokens`: the most tokens one request generates (--max-output-tokens);
        `max_tokens_policy`: what a max_tokens beyond the room the prompt leaves gets (--max-tokens-policy)."""
        assert vocab_size > 0 and max_model_len > 1, f"vocab {vocab_size}, max_model_len {max_model_len}"
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_output_tokens = max_output_tokens
        self.max_tokens_policy = max_tokens_policy
        # Characters one token covers at most (engine/front/prompt_bound.py); None: no bound.
        self.chars_per_token = None if tokenizer is None else chars_per_token_bound(tokenizer.backend)
        self.traits = None if tokenizer is None else template_probe(self._render_text, tokenizer.hf.name_or_path)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template shows a request's tools to the model (SmolLM2's does not)."""
        renders = getattr(self.tokenizer, "template_renders_tools", None)  # the tokenizer's own probe, if it has one
        if renders is not None:
            return bool(renders)
        return self.traits is not None and self.traits.renders_tools

    # ---- prompts to token ids (blocking: run them off the event loop) ------------------------------
    def chat_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> str:
        """The prompt text from the checkpoint's own chat template (ParamError when it fails):
        system messages after the first folded into the system prompt where the template takes
        them only first (engine/front/chat_messages.py)."""
        if self.traits is not None and not self.traits.renders_mid_system:
            messages = fold_system_messages(messages)
        return self._render_text(messages, tools, add_generation_prompt, **template_kwargs)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> list[int]:
        """Prompt ids from the checkpoint's own chat template (`chat_text`). ContextLengthError from
        the length in characters alone, before the tokenizer runs, when the prompt cannot fit: the
        messages' text is checked before the template runs too."""
        assert self.tokenizer is not None, "an InputProcessor without a tokenizer takes token ids only"
        # NOTE: a template renders every user, system and tool message's text in full (it may drop
        # old reasoning, or tools), so their length is a lower bound of the prompt's.
        self.check_prompt_chars(
            sum(
                len(m["content"])
                for m in messages
                if m.get("role") in ("system", "user", "tool") and isinstance(m.get("content"), str)
            )
        )
        text = self.chat_text(messages, tools, add_generation_prompt, template_kwargs)
        self.check_prompt_chars(len(text))
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote any BOS token

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids; ContextLengthError from its length alone when it cannot fit."""
        assert self.tokenizer is not None, "an InputProcessor without a tokenizer takes token ids only"
        self.check_prompt_chars(len(text))
        return self.tokenizer.encode(text)

    def check_prompt_chars(self, num_chars: int) -> None:
        """ContextLengthError (a lower bound of the prompt's tokens) when a text of `num_chars`
        characters has too many tokens for the context whatever they are: the check that lets an
        oversized prompt be refused before the tokenizer, or the template, runs."""
        if self.chars_per_token is None:
            return
        at_least = num_chars // self.chars_per_token
        if at_least >= self.max_model_len:
            raise ContextLengthError(at_least, None, self.max_model_len, at_least=True)

    def check_prompt_ids(self, num_tokens: int) -> None:
        """ContextLengthError for a prompt of `num_tokens` that leaves no room to generate."""
        if num_tokens >= self.max_model_len:
            raise ContextLengthError(num_tokens, None, self.max_model_len)

    def _render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        assert self.tokenizer is not None, "an InputProcessor without a tokenizer takes token ids only"
        return self.tokenizer.render_chat(messages, tools, add_generation_prompt, **template_kwargs)

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

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str = "") -> SamplingParams:
        """The parameters this request runs with (max_tokens resolved, an INFO line when it was
        lowered); ParamError naming the parameter for anything this model cannot run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ParamError("a prompt encodes to no tokens", "prompt")
        resolved = resolve_max_tokens(
            params.max_tokens, n, self.max_model_len, self.max_output_tokens, self.max_tokens_policy
        )
        if resolved.lowered_by is not None:
            assert params.max_tokens is not None, "only an asked-for max_tokens is lowered"
            why = (
                f"the room the {n}-token prompt leaves in the {self.max_model_len}-token context "
                "(--max-tokens-policy clamp)"
                if resolved.lowered_by == "context"
                else "--max-output-tokens"
            )
            logger.info("%s: max_tokens %d lowered to %d, %s", request_id, params.max_tokens, resolved.value, why)
        params = replace(params, max_tokens=resolved.value)
        if params.structured is not None:
            from engine.structured_output.manager import StructuredOutputs  # xgrammar: only for constrained requests

            StructuredOutputs.check(params.structured)
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
        params = self.validate(prompt_token_ids, params, request_id)
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
