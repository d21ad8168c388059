"""The agent test models: tiny Qwen3 checkpoints that the normal engine serves, for tests that
drive coding agents (tests/agents/). Each behaves as a minimal agent model:
- A user turn holding a tool call, `<tool_call>...</tool_call>` in the model's own format: the
  model makes that call (it copies it token by token, then ends its turn). A test, or a person
  trying an agent CLI, thus picks the call by writing it in the prompt.
- After a tool result: a plain answer, the result's first line.
- Anything else: an empty answer.

`qwen3` uses Qwen3's chat template (JSON calls, `--tool-parser auto` picks qwen3); `qwen3_coder`
a Qwen3-Coder-style one (fp4serve_tools/qwen3_coder_chat.jinja: XML calls, parser qwen3_coder).
The weights are the same: they copy whichever call the user wrote.

Why hand-built: agent tests need the same well-formed call on every run, from a real checkpoint
that the normal engine serves with no special case. A model trained for a few hundred CPU steps
on synthetic agent conversations did not learn to copy a call out of a long prompt (loss stuck
near 4 nats a token after 160 steps, measured 2026-11-26). NOTE: so the weights are written down
(fp4serve_tools/agent_weights.py says how): they copy exactly at any context length, in float32
and bfloat16, and build in seconds.

    python -m fp4serve_tools.agent_model --out DIR [--format qwen3_coder]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from dataclasses import asdict
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.host.cache_folder import build_once, cache_root
from engine.weights.demo_model import chat_template_text
from engine.weights.qwen_tokenizer import (
    QWEN3_VOCAB_SIZE,
    build_qwen_tokenizer,
    write_qwen_tokenizer_files,
)
from fp4serve_tools.agent_weights import Scales, Shape, build_weights

logger = logging.getLogger("fp4serve.agent_model")

JSON_FORMAT, XML_FORMAT = "qwen3", "qwen3_coder"
AGENT_MODEL_NAMES = {JSON_FORMAT: "fp4serve-agent-qwen3", XML_FORMAT: "fp4serve-agent-qwen3-coder"}
SPEC_FILE = "fp4serve_agent_model.json"
SEED = 20_261_126
BOS_TOKEN_ID = 151_643  # <|endoftext|>
EOS_TOKEN_ID = 151_645  # <|im_end|>


_MID_SYSTEM_TURN = "{{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}"
_MID_SYSTEM_RAISE = "{{- raise_exception('System message must be at the beginning.') }}"


def chat_template(fmt: str) -> str:
    """fp4serve's Qwen3 template for JSON calls, the Qwen3-Coder-style one beside this file for XML;
    both refuse a system message after the first, as Qwen3's own template does, so the server folds
    one into the system prompt. NOTE: the model copies the most recent match of each token pair
    and discounts only the first system turn: Claude Code's environment block, rendered as a system
    turn after the user's request, would hold matches more recent than the request."""
    if fmt == JSON_FORMAT:
        text = chat_template_text()
    else:
        assert fmt == XML_FORMAT, fmt
        text = (resources.files("fp4serve_tools") / "qwen3_coder_chat.jinja").read_text(encoding="utf-8")
    assert text.count(_MID_SYSTEM_TURN) == 1, "the template's mid-conversation system turn moved"
    return text.replace(_MID_SYSTEM_TURN, _MID_SYSTEM_RAISE)


def digest(fmt: str, shape: Shape | None = None, scales: Scales | None = None) -> str:
    """What the written files depend on: the construction's source and numbers, and the template."""
    shape, scales = shape or Shape(), scales or Scales()
    h = hashlib.sha256(
        json.dumps(
            {"fmt": fmt, "seed": SEED, "shape": asdict(shape), "scales": asdict(scales)}, sort_keys=True
        ).encode()
    )
    for name in ("agent_weights.py", "agent_model.py"):
        h.update((resources.files("fp4serve_tools") / name).read_bytes())
    h.update(chat_template(fmt).encode())
    return h.hexdigest()[:16]


def write_agent_model(
    dst: Path, fmt: str = JSON_FORMAT, shape: Shape | None = None, scales: Scales | None = None
) -> None:
    """An HF checkpoint folder: config, bf16 weights, the Qwen3 tokenizer with `fmt`'s template."""
    shape, scales = shape or Shape(), scales or Scales()
    dst.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen_tokenizer(cache_root())
    weights = build_weights(tokenizer, SEED, shape, scales)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    write_qwen_tokenizer_files(
        dst, chat_template(fmt), model_max_length=shape.max_position_embeddings, cache_dir=cache_root()
    )
    _write_json(dst / "config.json", _config(shape))
    # Greedy: the model is a program, sampling would only add noise to it.
    _write_json(
        dst / "generation_config.json",
        {
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
            "pad_token_id": BOS_TOKEN_ID,
            "do_sample": False,
        },
    )
    _write_json(
        dst / SPEC_FILE,
        {
            "name": AGENT_MODEL_NAMES[fmt],
            "format": fmt,
            "digest": digest(fmt, shape, scales),
            "seed": SEED,
            "shape": asdict(shape),
            "scales": asdict(scales),
        },
    )


def _config(s: Shape) -> dict[str, object]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": QWEN3_VOCAB_SIZE,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rope_theta": s.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": s.num_layers,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    }


def ensure_agent_model(fmt: str = JSON_FORMAT) -> Path:
    """The checkpoint folder for `fmt` under the cache root, written on first use (seconds)."""
    final = cache_root() / f"{AGENT_MODEL_NAMES[fmt]}-{digest(fmt)}"
    return build_once(final, lambda staging: write_agent_model(staging, fmt))


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fp4serve_tools.agent_model", description="Write an agent test model checkpoint folder."
    )
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write")
    parser.add_argument(
        "--format",
        choices=(JSON_FORMAT, XML_FORMAT),
        default=JSON_FORMAT,
        help="tool-call format of its chat template: qwen3 (JSON) or qwen3_coder (XML); default qwen3",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    write_agent_model(args.out, args.format)
    print(f"wrote {AGENT_MODEL_NAMES[args.format]} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
