"""The engine core's flags of `fp4serve serve`: the device and kernels, the batch, the KV cache and
its host tier, hybrid models' states, data parallel, the grammar cache and the KV-cache events."""

from __future__ import annotations

import argparse
from typing import Any

from api.flags.defaults import engine_default
from engine.front import KVEventsConfig, parse_memory
from engine.front.errors import ConfigError


def _size_bytes(text: str) -> int:
    """A size in bytes: 536870912, 512MiB, 1GB."""
    try:
        size, fraction = parse_memory(text)
    except ConfigError:
        size = fraction = None
    if size is None or fraction is not None:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB or 1GiB, got {text!r}")
    return size


def add_core_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--device",
        default=engine_default("device"),
        choices=("auto", "cpu", "cuda"),
        help="where the model runs; auto: cuda when available",
    )
    engine.add_argument(
        "--attention-backend",
        default=engine_default("attention_backend"),
        choices=("auto", "flashinfer", "cpu", "torch"),
        help="attention kernels; auto: flashinfer on CUDA; on CPU, cpu (paged attention compiled "
        "once per machine into $FP4SERVE_CACHE, no K/V gather) when g++ builds it, else torch (the "
        "reference: SDPA over gathered K/V)",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=int,
        default=engine_default("max_num_seqs"),
        metavar="N",
        help="most sequences in one running batch",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=engine_default("max_num_batched_tokens"),
        metavar="N",
        help="token budget of one step (prefill chunks + decodes)",
    )
    engine.add_argument(
        "--kv-cache-memory",
        default=None,
        metavar="SIZE",
        help="KV cache size: bytes (e.g. 4GiB, 512MiB) or a fraction of free device memory "
        "(e.g. 0.9); default: the engine's choice for the device",
    )
    engine.add_argument(
        "--kv-offloading-size",
        type=float,
        default=engine_default("kv_offloading_size"),
        metavar="GiB",
        help="host memory (GiB, as vLLM's flag) for a second prefix-cache tier: cached KV pages "
        "and hybrid models' state snapshots the device evicts are copied there, and a later prompt "
        "sharing the prefix copies them back instead of recomputing them; least recently used out; "
        "the start-up log gives its pages and snapshots; 0: off (README: Host KV tier)",
    )
    engine.add_argument(
        "--block-size", type=int, default=engine_default("block_size"), metavar="N", help="tokens per KV cache page"
    )
    engine.add_argument(
        "--kv-cache-dtype",
        default=engine_default("kv_cache_dtype"),
        choices=("auto", "bfloat16", "float16", "float32"),
        help="KV cache dtype; auto: the model's (--dtype); on CPU another one is taken, K/V cast "
        "as they are written and read (bfloat16 with --dtype float32 halves the cache and its "
        "reads, for bf16's rounding of K and V)",
    )
    engine.add_argument(
        "--num-state-slots",
        type=int,
        default=None,
        metavar="N",
        help="hybrid models (Qwen3.5/3.6): sequences that can hold a recurrent DeltaNet state at "
        "once (each slot is a fixed size, logged at start-up); default: --max-num-seqs, on a GPU at most "
        "a quarter of free memory",
    )
    engine.add_argument(
        "--linear-attention-backend",
        default=engine_default("linear_attention_backend"),
        choices=("auto", "torch", "fla"),
        help="hybrid models: Gated DeltaNet kernels; auto: fla-core on CUDA when it imports, "
        "the torch reference otherwise",
    )
    engine.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn off reuse of KV pages across requests sharing a prompt prefix",
    )
    engine.add_argument(
        "--num-state-checkpoints",
        type=int,
        default=None,
        metavar="N",
        help="hybrid models: prefix caching keeps the DeltaNet state after cached prefixes in N "
        "checkpoints (each a slot's size plus one KV page, logged at start-up), evicted least "
        "recently used together with the KV pages they need; 0 turns prefix caching off for hybrids; "
        "default: on a GPU a fifth of free memory, on CPU 256 MiB",
    )
    engine.add_argument(
        "--state-checkpoint-spacing",
        type=float,
        default=None,
        metavar="F",
        help="hybrid models: besides prompt ends, sequence ends and shared-prefix junctions, a prefill "
        "keeps its state at page boundaries at most F x their position apart, so a later request "
        "sharing a prefix with it restores at least 1/(1+F) of the prefix; 0: none; default: as dense "
        "as half the checkpoints allow for one max-model-len context",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="decode without CUDA graphs (graphs are captured at start-up on CUDA otherwise)",
    )
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and prepare each step while the device computes the one before, its sampled "
        "ids read back one step late (steps needing host knowledge of the last token: grammars, "
        "speculative decoding, hybrid models' states, run synchronously); default: on with CUDA, "
        "off on CPU",
    )
    engine.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=engine_default("data_parallel_size"),
        metavar="N",
        help="run N engine cores behind this one server, each a process with its own "
        "GPU (CUDA_VISIBLE_DEVICES narrowed to one each) or, on CPU, its own 1/N of the CPUs, and its "
        "own KV cache as --kv-cache-memory sizes it; each request goes to the core holding the longest "
        "cached prefix of its prompt unless that core is much busier than the least busy one; fair "
        "share, per-key limits and the queue bounds are over all the cores (docs/deploy.md)",
    )
    engine.add_argument(
        "--grammar-cache-bytes",
        type=_size_bytes,
        default=engine_default("grammar_cache_bytes"),
        metavar="SIZE",
        help="most memory of compiled grammars (response_format schemas, forced tool calls) kept "
        "for reuse, least recently used out (default: 512MiB; 0 keeps none). Each API key compiles one "
        "grammar at a time, keys taking turns, so one key's large schemas never hold up the others'",
    )
    engine.add_argument(
        "--in-process-engine",
        action="store_true",
        help="run the engine core (scheduler and model) on a thread of the HTTP process instead of "
        "a process of its own: for debugging; the forward then shares the GIL with HTTP",
    )
    engine.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) in vLLM's wire "
        "format for cache-aware routers (llm-d, vllm-router): vLLM's KVEventsConfig as JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'; block hashes are vLLM\'s '
        "sha256_cbor chain seeded by $PYTHONHASHSEED (docs/deploy.md); default: off",
    )


def core_engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Raises ConfigError for --data-parallel-size with --in-process-engine: the engine runs cores
    as threads only for tests (tests/engine/test_data_parallel.py), the server never."""
    if args.data_parallel_size > 1 and args.in_process_engine:
        raise ConfigError("--data-parallel-size: each engine core is a process of its own; drop --in-process-engine")
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory": args.kv_cache_memory,
        "kv_offloading_size": args.kv_offloading_size,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "enable_prefix_caching": not args.no_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "engine_process": not args.in_process_engine,
        "attention_backend": args.attention_backend,
        "device": args.device,
        "num_state_slots": args.num_state_slots,
        "num_state_checkpoints": args.num_state_checkpoints,
        "state_checkpoint_spacing": args.state_checkpoint_spacing,
        "linear_attention_backend": args.linear_attention_backend,
        "data_parallel_size": args.data_parallel_size,
        "kv_events_config": KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None,
        "grammar_cache_bytes": args.grammar_cache_bytes,
    }
