"""`RequestLimits`: what one request may ask of the server, so that no single client can make it
do unbounded work. Each field is a `fp4serve serve` flag; breaking one is a 400 naming the
parameter and the flag, from the request models' validators (api/request/models.py); the body size, a
413, is `ServerConfig.max_request_bytes`."""

from __future__ import annotations

from dataclasses import dataclass

from engine.front.errors import ConfigError

HARD_MAX_LOGPROBS = 20  # what the sampler computes (and OpenAI's own cap)


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 16  # choices per prompt
    max_output_tokens: int | None = None  # cap on max_tokens, and its value when absent; None: the context
    max_logprobs: int = HARD_MAX_LOGPROBS  # top_logprobs (chat) / logprobs (completions)
    max_stop: int = 16  # stop strings; also stop_token_ids
    max_stop_length: int = 256  # characters of one stop string
    max_tools: int = 128

    def __post_init__(self) -> None:
        for flag, value, low in (
            ("--max-n", self.max_n, 1),
            ("--max-output-tokens", self.max_output_tokens, 1),
            ("--max-stop", self.max_stop, 0),
            ("--max-stop-length", self.max_stop_length, 1),
            ("--max-tools", self.max_tools, 0),
        ):
            if value is not None and value < low:
                raise ConfigError(f"{flag}: {'must be positive' if low else 'must not be negative'}, got {value}")
        if not 0 <= self.max_logprobs <= HARD_MAX_LOGPROBS:
            raise ConfigError(f"--max-logprobs: must be in 0..{HARD_MAX_LOGPROBS}, got {self.max_logprobs}")
