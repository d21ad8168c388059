"""The bounds flags of `fp4serve serve`: what one request may ask, the waiting queue, the
request timeout and the shutdown drain."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from api.access.limits import HARD_MAX_LOGPROBS, RequestLimits
from api.app import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_SHUTDOWN_TIMEOUT_S
from api.errors import OVERLOADED_RETRY_AFTER_S
from engine.front import MAX_CONSECUTIVE_FAILURES, QueueLimits


def _limit_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(RequestLimits) if f.name == name)


def _count_or_none(text: str) -> int | None:
    """A bound that can be switched off: an integer, or `none`."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def add_limits_arguments(parser: argparse.ArgumentParser) -> None:
    limits = parser.add_argument_group(
        "limits", "what one request may ask (above a limit: 400 naming the parameter and the flag)"
    )
    limits.add_argument(
        "--max-n", type=int, default=_limit_default("max_n"), metavar="N", help="most choices (n) per prompt"
    )
    limits.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        metavar="N",
        help="most tokens one request may generate: a larger max_tokens is lowered to it (the "
        "reply then ends with finish_reason length), an absent one means this many; default: the "
        "rest of the context",
    )
    limits.add_argument(
        "--max-logprobs",
        type=int,
        default=_limit_default("max_logprobs"),
        metavar="N",
        help=f"most top_logprobs (chat) / logprobs (completions), at most {HARD_MAX_LOGPROBS}",
    )
    limits.add_argument(
        "--max-stop",
        type=int,
        default=_limit_default("max_stop"),
        metavar="N",
        help="most stop strings, and most stop_token_ids, per request",
    )
    limits.add_argument(
        "--max-stop-length",
        type=int,
        default=_limit_default("max_stop_length"),
        metavar="CHARS",
        help="longest stop string",
    )
    limits.add_argument(
        "--max-tools", type=int, default=_limit_default("max_tools"), metavar="N", help="most tools per chat request"
    )
    limits.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end a request running longer than this after it arrived, and free its KV pages: a "
        "stream gets an SSE error event (type timeout_error, code request_timeout), a "
        "non-streaming request a 504 with that body and x-should-retry: false; default: no limit",
    )

    load = parser.add_argument_group(
        "load and lifecycle",
        f"A full queue answers 503 with Retry-After: {OVERLOADED_RETRY_AFTER_S} and the body "
        '{"error": {"type": "overloaded_error", "code": "server_overloaded", ...}}; the OpenAI SDK retries it '
        "(max_retries, 2 by default), honouring Retry-After. Admitted requests are never affected. If the "
        f"engine fails {MAX_CONSECUTIVE_FAILURES} steps in a row (or its loop dies), every in-flight request gets "
        "an error, /health turns 503 and the process exits with status 1 so that a supervisor restarts it.",
    )
    load.add_argument(
        "--max-queued-requests",
        type=_count_or_none,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        metavar="N",
        help="most requests waiting for a batch slot: admitted (being tokenized or in the "
        "engine's queue) but not running, beyond the free slots of --max-num-seqs the next step "
        "fills; each of n samples counts; or none",
    )
    load.add_argument(
        "--max-queued-tokens",
        type=_count_or_none,
        default=None,
        metavar="T",
        help="most prompt tokens waiting for a batch slot, or none; default: none",
    )
    load.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, /health turns 503 and new requests get 503 while in-flight ones "
        "finish, for up to this long; then those left end with an error (an SSE error event with "
        "code server_stopping, or a 503). A second signal stops the wait at once. Exit status 0",
    )


def limits_server_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "limits": RequestLimits(
            max_n=args.max_n,
            max_output_tokens=args.max_output_tokens,
            max_logprobs=args.max_logprobs,
            max_stop=args.max_stop,
            max_stop_length=args.max_stop_length,
            max_tools=args.max_tools,
        ),
        "queue": QueueLimits(max_queued_requests=args.max_queued_requests, max_queued_tokens=args.max_queued_tokens),
        "request_timeout_s": args.request_timeout,
        "shutdown_timeout_s": args.shutdown_timeout,
    }
