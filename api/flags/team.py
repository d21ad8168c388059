"""The team-endpoint flags of `fp4serve serve` (issue 17): keys, scheduling policy, long-prompt
isolation, body timeout and the prompts cap. Their own module so api/flags/serve.py only calls in."""

from __future__ import annotations

import argparse
from typing import Any

from api.access.keys import parse_keys_file
from api.state import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_PROMPTS
from engine.front import DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD


def add_team_arguments(parser: argparse.ArgumentParser) -> None:
    team = parser.add_argument_group(
        "team endpoint",
        "Several users share the server: each API key is a tenant with a name (in logs, metrics and "
        "/v1/usage), a fair-share weight, a priority and optional limits. A key over its limit gets 429 with "
        "Retry-After and x-ratelimit-* headers, code rate_limit_exceeded.",
    )
    team.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help="TOML file of [[keys]] tables: name, key or key_sha256, and optional weight (default 1), "
        "priority (default 0, lower first), max_concurrent, rpm, tpm, admin (sees every key's "
        "/v1/usage). SIGHUP reloads it without dropping requests. Not with --api-key (which is one "
        "key named 'default')",
    )
    team.add_argument(
        "--scheduling-policy",
        default="fair",
        choices=("fair", "fcfs", "priority"),
        help="admission order of waiting requests: fair (weighted fair share of served tokens "
        "across keys, then the request's priority, then arrival), fcfs (arrival), priority (key "
        "priority, then the request's priority, then arrival; lower first)",
    )
    team.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
        metavar="N",
        help="most prompt tokens one request prefills per step, so decodes and short "
        "prompts keep flowing while a long prompt prefills; 0: no cap",
    )
    team.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="a request body must arrive within this, or the request gets 408 and holds nothing",
    )
    team.add_argument(
        "--max-prompts",
        type=int,
        default=DEFAULT_MAX_PROMPTS,
        metavar="N",
        help="most prompts in one /v1/completions request (400 above it)",
    )


def team_engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "scheduling_policy": args.scheduling_policy,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
    }


def team_server_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Raises ConfigError for a bad keys file, at start-up rather than at the first request."""
    if args.api_keys_file:
        parse_keys_file(args.api_keys_file)
    return {"api_keys_file": args.api_keys_file, "body_timeout_s": args.body_timeout, "max_prompts": args.max_prompts}
