"""The flags of the engine's supervisor (engine/client/supervisor.py): the watchdog's step timeout, the
start-up allowance, and how many lost engines are replaced before the server gives up. Their own
module so api/flags/serve.py only calls in."""

from __future__ import annotations

import argparse
from typing import Any

from engine.front import EngineConfig

_DEFAULTS = EngineConfig()


def add_reliability_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "reliability",
        "The engine runs in a process of its own. When that process is lost (it crashed, or hung and the "
        "watchdog killed it), the requests it held end with an error, /health answers 503 'restarting', and a "
        "new engine loads with the same settings; requests that arrive meanwhile wait for it. Not with "
        "--in-process-engine, where a dead engine stops the server.",
    )
    group.add_argument(
        "--engine-step-timeout",
        "--watchdog-timeout",
        type=float,
        metavar="SECONDS",
        default=_DEFAULTS.engine_step_timeout_s,
        help="an engine step (one batch's forward) that makes no progress for this long counts as "
        "a hang: the engine process is killed and restarted (on a GPU the first step of each engine "
        "gets twice as long: it may compile kernels); raise it if one prefill chunk of your model takes "
        "longer on your hardware; 0: no watchdog",
    )
    group.add_argument(
        "--engine-start-timeout",
        type=float,
        metavar="SECONDS",
        default=_DEFAULTS.engine_start_timeout_s,
        help="most seconds an engine process may take to load the model and say it is ready; 0: no limit",
    )
    group.add_argument(
        "--engine-max-restarts",
        type=int,
        metavar="N",
        default=_DEFAULTS.engine_max_restarts,
        help="lost engines replaced within --engine-restart-window; one more failure (a loss, or "
        "a restart that fails to load) and the server exits with status 1, saying why; 0: no "
        "restarts (a lost engine stops the server)",
    )
    group.add_argument(
        "--engine-restart-window",
        type=float,
        metavar="SECONDS",
        default=_DEFAULTS.engine_restart_window_s,
        help="the sliding window --engine-max-restarts counts failures in",
    )


def reliability_engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "engine_step_timeout_s": args.engine_step_timeout,
        "engine_start_timeout_s": args.engine_start_timeout,
        "engine_max_restarts": args.engine_max_restarts,
        "engine_restart_window_s": args.engine_restart_window,
    }
