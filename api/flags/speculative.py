"""The speculative-decoding flags of `fp4serve serve`, one by one or as vLLM's --speculative-config
JSON (engine/spec_decode/config.py reads that)."""

from __future__ import annotations

import argparse
from typing import Any

from api.flags.defaults import engine_default
from engine.front.errors import ConfigError


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-method",
        default=None,
        choices=("ngram", "mtp"),
        help="draft tokens and verify them in the batch: ngram (prompt lookup, any model) or "
        "mtp (the multi-token-prediction head of dense Qwen3.5/3.6 checkpoints: their mtp.* "
        "weights, or --speculative-model's); exact for greedy, the same distribution when sampling; default: off",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=engine_default("num_speculative_tokens"),
        metavar="K",
        help="most draft tokens per request and step",
    )
    spec.add_argument(
        "--ngram-min",
        type=int,
        default=engine_default("ngram_min"),
        metavar="N",
        help="ngram: shortest context suffix looked up earlier in the context",
    )
    spec.add_argument(
        "--ngram-max",
        type=int,
        default=engine_default("ngram_max"),
        metavar="N",
        help="ngram: longest context suffix looked up (tried first)",
    )
    spec.add_argument(
        "--speculative-max-batch",
        type=int,
        default=None,
        metavar="N",
        help="draft only while at most N sequences run (speculation pays at small batches); "
        "default: the measured crossover (docs/PERF.md)",
    )
    spec.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each request's draft length follows its acceptance: after a rejected draft one more "
        "than were accepted, after a fully accepted step twice as many, up to --num-speculative-tokens; "
        "default: on on CPU (a rejected draft's row costs as much as an accepted one's), off with CUDA",
    )
    spec.add_argument(
        "--speculative-model",
        default=None,
        metavar="PATH",
        help="mtp: take the MTP head (mtp.* tensors) from this checkpoint folder of the same model "
        "(bf16 or block-wise FP8, e.g. Qwen3.6-27B-FP8 beside an NVFP4 export that dropped it); "
        "implies --speculative-method mtp",
    )
    spec.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s form of the flags above, e.g. \'{"method": "mtp", "num_speculative_tokens": 3, '
        '"model": PATH}\' (keys: method (ngram, mtp, qwen3_next_mtp), num_speculative_tokens, model, '
        "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size)",
    )


# --speculative-config's fields and the flags that set them one by one
_SPECULATIVE_FLAGS = {
    "speculative_method": "--speculative-method",
    "num_speculative_tokens": "--num-speculative-tokens",
    "ngram_min": "--ngram-min",
    "ngram_max": "--ngram-max",
    "speculative_max_batch": "--speculative-max-batch",
    "speculative_model": "--speculative-model",
}


def speculative_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The speculative EngineConfig fields from the flags, or from vLLM's --speculative-config JSON
    (a value given both ways is refused). --speculative-model alone means --speculative-method mtp."""
    from engine.front import speculative_config_fields

    settings = {field: getattr(args, field) for field in _SPECULATIVE_FLAGS}
    if args.speculative_config is not None:
        for field, value in speculative_config_fields(args.speculative_config).items():
            default = engine_default(field) if field not in ("speculative_max_batch", "speculative_model") else None
            if settings[field] != default:
                raise ConfigError(
                    f"--speculative-config: sets {field.removeprefix('speculative_')}, which "
                    f"{_SPECULATIVE_FLAGS[field]} sets too; give it once"
                )
            settings[field] = value
    if settings["speculative_model"] is not None and settings["speculative_method"] is None:
        settings["speculative_method"] = "mtp"
    settings["speculative_adaptive"] = args.speculative_adaptive  # not one of vLLM's keys
    return settings
