"""A prompt that does not fit the context, in each protocol's own words, because clients parse them
to recover: Claude Code retries with a smaller max_tokens on Anthropic's "input length and
`max_tokens` exceed context limit: P + C > M" and compacts its context on "prompt is too long: N
tokens > M maximum"; OpenAI clients (Codex, LiteLLM, the SDKs' users) look for the code
`context_length_exceeded` and OpenAI's "This model's maximum context length is M tokens. However,
you requested ..." (vLLM words it the same way). The numbers come from the engine's
`ContextLengthError`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from api.errors import APIError
from engine.front.errors import CONTEXT_LENGTH_EXCEEDED, ContextLengthError, ParamError


@dataclass(frozen=True)
class Dialect:
    """What one API calls the prompt and max_tokens, and whose words its refusals use."""

    prompt_param: str  # messages | input | prompt
    max_tokens_param: str = "max_tokens"  # or max_output_tokens (Responses), max_completion_tokens
    anthropic: bool = False


CHAT = Dialect("messages")
COMPLETIONS = Dialect("prompt")
RESPONSES = Dialect("input", "max_output_tokens")
MESSAGES = Dialect("messages", anthropic=True)


def context_length_error(error: ContextLengthError, dialect: Dialect) -> APIError:
    """The 400 (invalid_request_error, code context_length_exceeded) for `error` in `dialect`'s words."""
    too_long_alone = error.max_tokens is None
    param = dialect.prompt_param if too_long_alone else dialect.max_tokens_param
    message = _anthropic(error) if dialect.anthropic else _openai(error, dialect.prompt_param)
    return APIError(400, message, param, CONTEXT_LENGTH_EXCEEDED)


@contextmanager
def refusals(dialect: Dialect) -> Iterator[None]:
    """The engine's refusals in the API's names and words: a prompt that does not fit the context
    (api/context_errors.py), and "prompt" renamed to the API's own field."""
    try:
        yield
    except ContextLengthError as e:
        raise context_length_error(e, dialect) from None
    except ParamError as e:
        if e.param == "prompt":
            e.param = dialect.prompt_param
        raise


def _anthropic(error: ContextLengthError) -> str:
    if error.max_tokens is None:
        # One token must be left to generate: the longest prompt is one short of the context.
        return f"prompt is too long: {error.num_prompt_tokens} tokens > {error.max_model_len - 1} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {error.num_prompt_tokens} + {error.max_tokens} > "
        f"{error.max_model_len}, decrease input length or `max_tokens` and try again"
    )


def _openai(error: ContextLengthError, prompt_word: str) -> str:
    head = f"This model's maximum context length is {error.max_model_len} tokens."
    if error.max_tokens is None:
        count = f"at least {error.num_prompt_tokens}" if error.at_least else str(error.num_prompt_tokens)
        return (
            f"{head} However, your {prompt_word} resulted in {count} tokens. Please reduce the length of the "
            f"{prompt_word}."
        )
    total = error.num_prompt_tokens + error.max_tokens
    return (
        f"{head} However, you requested {total} tokens ({error.num_prompt_tokens} in the {prompt_word}, "
        f"{error.max_tokens} in the completion). Please reduce the length of the {prompt_word} or completion."
    )
