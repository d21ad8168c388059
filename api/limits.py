"""`RequestLimits`: what one request may ask of the server, so that no single client can make it
do unbounded work. Each field is a `fp4serve serve` flag; breaking one is a 400 naming the
parameter and the flag (the body size, a 413, is `ServerConfig.max_request_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass

from api.errors import APIError, bad_request
from engine.config import ConfigError

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
        for flag, value, low in (("--max-n", self.max_n, 1), ("--max-output-tokens", self.max_output_tokens, 1),
                                 ("--max-stop", self.max_stop, 0), ("--max-stop-length", self.max_stop_length, 1),
                                 ("--max-tools", self.max_tools, 0)):
            if value is not None and value < low:
                raise ConfigError(f"{flag}: must be at least {low}, got {value}")
        if not 0 <= self.max_logprobs <= HARD_MAX_LOGPROBS:
            raise ConfigError(f"--max-logprobs: must be in 0..{HARD_MAX_LOGPROBS}, got {self.max_logprobs}")


def too_many(param: str, count: int, limit: int, flag: str) -> APIError:
    return bad_request(f"{param} has {count} entries; this server allows at most {limit} ({flag})", param)


def check_stop(stop: tuple[str, ...], stop_token_ids: list[int], limits: RequestLimits) -> None:
    if len(stop) > limits.max_stop:
        raise too_many("stop", len(stop), limits.max_stop, "--max-stop")
    if len(stop_token_ids) > limits.max_stop:
        raise too_many("stop_token_ids", len(stop_token_ids), limits.max_stop, "--max-stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_length:
        raise bad_request(
            f"stop has a string of {longest} characters; this server allows at most {limits.max_stop_length} "
            "(--max-stop-length)",
            "stop",
        )


def check_max_tokens(requested: int | None, limits: RequestLimits, param: str) -> None:
    cap = limits.max_output_tokens
    if requested is not None and cap is not None and requested > cap:
        raise bad_request(
            f"{param} is {requested}; this server generates at most {cap} tokens per request (--max-output-tokens)",
            param,
        )
