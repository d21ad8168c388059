"""The HTTP flags of `fp4serve serve`: where it listens, the API key, CORS, the body limit, the
Responses store, the output parsers, the web page and the log level."""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path
from typing import Any

from api.access.keys import API_KEY_ENV
from api.app import DEFAULT_MAX_REQUEST_BYTES
from engine.front.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")

logger = logging.getLogger("fp4serve")


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 or :: for all)")
    http.add_argument("--port", type=int, default=8000, help="TCP port")
    # NOTE: the env value is read in server_config, not used as the default: --help prints defaults.
    http.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1/*; never logged. Prefer --api-key-file or "
        f"${API_KEY_ENV}: a command line is visible to every user of the machine (ps), so this flag "
        "logs a warning; default: no key",
    )
    http.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="read the one API key (as --api-key) from the first line of FILE, which only the "
        "server's user should be able to read; not with --api-key or --api-keys-file (a TOML file of "
        "several named keys)",
    )
    http.add_argument(
        "--cors-origins",
        default=None,
        metavar="ORIGINS",
        help="comma-separated origins allowed by CORS, or '*'; default: no CORS headers",
    )
    http.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help="largest request body accepted (413 above it)",
    )
    http.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        metavar="N",
        help="how many /v1/responses replies are kept in memory for previous_response_id and "
        "GET /v1/responses/{id}, least recently used dropped first; 0 stores none",
    )
    http.add_argument(
        "--tool-parser",
        default=None,
        metavar="NAME",
        help="parse tool calls out of chat output: qwen3 (alias hermes), qwen3_coder, or auto "
        "(chosen from the chat template); default: none",
    )
    http.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split <think> reasoning into reasoning_content: qwen3, or auto (from the chat template); default: none",
    )
    http.add_argument(
        "--no-ui",
        action="store_true",
        help="do not serve the built-in web page (chat playground and live dashboard) at /; "
        "/stats, its JSON feed, stays",
    )
    http.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="server log verbosity")


def http_server_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Raises ConfigError for a parser name that does not exist or an API key that cannot be read."""
    _check_parser_names(args.tool_parser, args.reasoning_parser)
    origins = tuple(o.strip() for o in (args.cors_origins or "").split(",") if o.strip())
    return {
        "host": args.host,
        "port": args.port,
        "api_key": _api_key(args),
        "cors_origins": origins,
        "tool_parser": args.tool_parser,
        "reasoning_parser": args.reasoning_parser,
        "max_request_bytes": args.max_request_bytes,
        "responses_store_size": args.responses_store_size,
        "ui": not args.no_ui,
    }


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file's first line, else $FP4SERVE_API_KEY; ConfigError for a file
    that cannot be read or holds no key. NOTE: the key itself never reaches a message or a log."""
    if args.api_key and args.api_key_file:
        raise ConfigError("--api-key and --api-key-file: give one of them")
    if args.api_key:
        logger.warning(
            "--api-key on the command line is visible to every user of this machine (ps, /proc); "
            "use --api-key-file or $%s instead",
            API_KEY_ENV,
        )
        return args.api_key
    if args.api_key_file:
        path = Path(args.api_key_file)
        try:
            lines = path.read_text().strip().splitlines()
            mode = path.stat().st_mode
        except OSError as e:
            raise ConfigError(f"--api-key-file {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--api-key-file {path}: not a text file") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"--api-key-file {path}: holds no key (the first line is read)")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(
                "--api-key-file %s can be read by other users (mode %o); chmod 600 it", path, stat.S_IMODE(mode)
            )
        return key
    return os.environ.get(API_KEY_ENV) or None


def _check_parser_names(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """Fail on a misspelt parser before the model loads; `auto` waits for the chat template."""
    if {tool_parser, reasoning_parser} <= {None, "auto"}:
        return
    from api.parsers import UnknownParserError, resolve_reasoning_parser, resolve_tool_parser

    try:
        if tool_parser != "auto":
            resolve_tool_parser(tool_parser)
        if reasoning_parser != "auto":
            resolve_reasoning_parser(reasoning_parser)
    except UnknownParserError as e:
        flag = "--tool-parser" if e.kind == "tool" else "--reasoning-parser"
        raise ConfigError(f"{flag}: {e}") from None
