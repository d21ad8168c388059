"""The flags for what clients, agents above all, meet at the front: what a max_tokens beyond the
room the prompt leaves gets, the checkpoint's sampling defaults, and the access log. Their own
module so api/flags/serve.py only calls in."""

from __future__ import annotations

import argparse
from typing import Any

from engine.front import MAX_TOKENS_POLICIES


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "requests and logs",
        "Agents send max_tokens 32000 or 64000 whatever the model's context, and never send sampling values. "
        "Every refused request (4xx, 5xx) leaves one log line (method, path, status, key, code, param, client, "
        "message) and counts in fp4serve_http_requests_rejected_total{reason}.",
    )
    group.add_argument(
        "--max-tokens-policy",
        default="clamp",
        choices=MAX_TOKENS_POLICIES,
        help="a max_tokens larger than the room the prompt leaves in the context: clamp lowers it to "
        "that room (the reply then ends with finish_reason length / stop_reason max_tokens, and one "
        "INFO line says so), reject answers 400 context_length_exceeded in the API's own words (as "
        "vLLM and OpenAI do)",
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for requests "
        "that leave them out: auto reads the model's generation_config.json, vllm applies none "
        "(OpenAI's defaults), a folder reads its generation_config.json; logged at start-up",
    )
    group.add_argument(
        "--access-log",
        action="store_true",
        help="log one INFO line per HTTP request (client, method, path, status, key, seconds); refused "
        "requests are logged either way",
    )
    group.add_argument(
        "--disable-access-log-for-endpoints",
        default="/health,/metrics",
        metavar="PATHS",
        help="comma-separated paths left out of the access log and of the refused-request lines and "
        "count (empty: none)",
    )


def agent_engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"generation_config": args.generation_config}


def agent_server_settings(args: argparse.Namespace) -> dict[str, Any]:
    skipped = tuple(p.strip() for p in args.disable_access_log_for_endpoints.split(",") if p.strip())
    return {
        "max_tokens_policy": args.max_tokens_policy,
        "access_log": args.access_log,
        "access_log_skipped_paths": skipped,
    }
