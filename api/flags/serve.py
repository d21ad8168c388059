"""`fp4serve serve`'s flags, by topic (this package's modules), in the order --help shows them, and
`server_config`, which maps them one-to-one onto `EngineConfig` and `ServerConfig`: each config
checks its own fields' bounds, so a bad value is one ConfigError line naming its flag."""

from __future__ import annotations

import argparse

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
