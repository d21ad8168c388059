"""The engine's typed errors that more than one of its modules raise: `ConfigError` (a checkpoint
or flag the server cannot run) and `ContextLengthError` (a request that does not fit the context).
A module of its own, importing nothing of the engine, so config.py and the model-config readers it
calls (hybrid_config.py) share ConfigError without importing each other."""

from __future__ import annotations

from scheduler.request import ParamError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ConfigError(ValueError):
    """A checkpoint or flag the server cannot run; the message is one line naming the field."""


class ContextLengthError(ParamError):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context. The numbers are
    fields, so a protocol can word the refusal its own way (api/context_errors.py); `param` is
    "prompt" (a prompt that leaves no room) or "max_tokens". `at_least`: the prompt was refused
    from its length in characters, before it was tokenized, so `num_prompt_tokens` is a lower
    bound (engine/front/prompt_bound.py)."""

    def __init__(
        self, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, at_least: bool = False
    ) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens  # the requested value; None when the prompt alone is too long
        self.max_model_len = max_model_len
        self.at_least = at_least
        count = f"at least {num_prompt_tokens}" if at_least else str(num_prompt_tokens)
        if max_tokens is None:
            message, param = (
                (
                    f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                    f"{count} tokens (at least one token must be left to generate)"
                ),
                "prompt",
            )
        else:
            message, param = (
                (
                    f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                    f"{count} tokens and max_tokens asks for {max_tokens} more"
                ),
                "max_tokens",
            )
        super().__init__(message, param, CONTEXT_LENGTH_EXCEEDED)
