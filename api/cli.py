"""The `fp4serve` command: `serve` (hypercorn started from code, uvloop where installed) and
`parse-output` (api/parsers/parse_output.py). The serve flags live in api/flags/ (by topic) and map
one-to-one onto `EngineConfig` and `ServerConfig` fields; room is left for more subcommands (e.g.
`quantize`)."""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import logging
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any

# NOTE: the serve flags (which import the app) and the engine's errors load on use, not here. The
# engine's process is spawned from `python -m api.cli`, and a spawned child imports the main
# module again: a heavy import here would be paid by every engine start and restart.


def __getattr__(name: str) -> Any:
    """`server_config`, importable from here as before (tests build configs with it)."""
    if name == "server_config":
        from api.flags.serve import server_config

        return server_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default:" in help_text or action.default in (None, False, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action) or help_text


def serve(args: argparse.Namespace) -> int:
    from api.flags.serve import server_config
    from engine.front.errors import ConfigError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = server_config(args)
        _check_port_free(config.host, config.port)
    except (ConfigError, OSError) as e:
        print(f"fp4serve serve: error: {e}", file=sys.stderr)
        return 2
    from api.server import Server

    code = _event_loop_runner()(Server(config, log_level=args.log_level).run())
    # NOTE: the interpreter's teardown runs the cyclic collector over every object left, and
    # torch, transformers and xgrammar leave hundreds of thousands: seconds of every exit. The
    # server is done with them: frozen, they are not scanned (exit handlers still run).
    gc.freeze()
    return code


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run
    return uvloop.run


def _check_port_free(host: str, port: int) -> None:
    """Fail before the model loads rather than after: hypercorn binds only once start-up ran."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _add_parse_output(commands: Any) -> None:
    # Another module owns this subcommand; the CLI works without it.
    if importlib.util.find_spec("api.parsers.parse_output") is None:
        return
    try:
        module = importlib.import_module("api.parsers.parse_output")
    except ImportError:
        return
    parser = commands.add_parser(
        "parse-output", help="parse a saved model output with a tool/reasoning parser", formatter_class=_HelpFormatter
    )
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)


# Subcommands whose modules import torch: loaded only when chosen, so `fp4serve --help` is quick.
_ENGINE_COMMANDS = {
    "quantize": (
        "fp4serve_tools.quantize",
        "write an NVFP4 checkpoint (ModelOpt or compressed-tensors layout) from a bf16/fp32 one",
    ),
    "bundle": (
        "fp4serve_tools.bundle",
        "build an offline GPU bundle: trimmed FlashInfer and the wheels it needs, with "
        "prebuilt kernels, for air-gapped GPU servers",
    ),
}


def _add_engine_commands(commands: Any, chosen: str | None) -> None:
    for name, (module_name, text) in _ENGINE_COMMANDS.items():
        parser = commands.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(parser)
            parser.set_defaults(run=module.run)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """`argv` (the arguments to parse) tells which subcommand's module to load."""
    from api.flags.serve import add_serve_arguments

    parser = argparse.ArgumentParser(prog="fp4serve", description="An OpenAI-compatible LLM server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        formatter_class=_HelpFormatter,
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics, /stats, /version) and a web page at / (chat playground, live dashboard).",
    )
    add_serve_arguments(serve_parser)
    serve_parser.set_defaults(run=serve)
    _add_parse_output(commands)
    _add_engine_commands(commands, next((a for a in argv or () if not a.startswith("-")), None))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
