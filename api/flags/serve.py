"""`fp4serve serve`'s flags, by topic (this package's modules), in the order --help shows them, and
`server_config`, which maps them one-to-one onto `EngineConfig` and `ServerConfig`: each config
checks its own fields' bounds, so a bad value is one ConfigError line naming its flag."""

from __future__ import annotations

import argparse

from api.access.limits import HARD_MAX_LOGPROBS
from api.app import ServerConfig
from api.flags.agent import add_agent_arguments, agent_engine_settings, agent_server_settings
from api.flags.core import add_core_arguments, core_engine_settings
from api.flags.limits import add_limits_arguments, limits_server_settings
from api.flags.model import add_model_arguments, model_engine_settings
from api.flags.reliability import add_reliability_arguments, reliability_engine_settings
from api.flags.server import add_http_arguments, http_server_settings
from api.flags.speculative import add_speculative_arguments, speculative_settings
from api.flags.team import add_team_arguments, team_engine_settings, team_server_settings
from engine.front import EngineConfig
from engine.front.errors import ConfigError


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_core_arguments(parser)
    add_speculative_arguments(parser)
    add_http_arguments(parser)
    add_limits_arguments(parser)
    add_team_arguments(parser)
    add_reliability_arguments(parser)
    add_agent_arguments(parser)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """Raises ConfigError (one line naming the flag) for a value the server cannot use."""
    for flag in ("max_num_seqs", "max_num_batched_tokens", "max_request_bytes", "max_n", "max_stop_length"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be positive, got {getattr(args, flag)}")
    for flag in ("max_output_tokens", "max_queued_requests", "max_queued_tokens", "request_timeout"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be positive, got {value}")
    for flag in ("max_stop", "max_tools", "shutdown_timeout"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')}: must not be negative, got {getattr(args, flag)}")
    if not 0 <= args.max_logprobs <= HARD_MAX_LOGPROBS:
        raise ConfigError(f"--max-logprobs: must be in 0..{HARD_MAX_LOGPROBS}, got {args.max_logprobs}")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port: must be in 1..65535, got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ConfigError(f"--max-model-len: must be at least 2, got {args.max_model_len}")
    if args.data_parallel_size > 1 and args.in_process_engine:
        raise ConfigError("--data-parallel-size: each engine core is a process of its own; drop --in-process-engine")
    engine = EngineConfig(
        **model_engine_settings(args),
        **core_engine_settings(args),
        **team_engine_settings(args),
        **reliability_engine_settings(args),
        **speculative_settings(args),
        **agent_engine_settings(args),
    )
    return ServerConfig(
        engine=engine,
        **http_server_settings(args),
        **limits_server_settings(args),
        **team_server_settings(args),
        **agent_server_settings(args),
    )
