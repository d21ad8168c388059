"""The embedded demo model `make serve` runs when no checkpoint is given: a tiny Qwen3 with seeded
random weights, Qwen3's real tokenizer and fp4serve's chat template, written once as an HF
checkpoint folder under the cache root (`$FP4SERVE_CACHE`, else `~/.cache/fp4serve`)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.weights.qwen_tokenizer import QWEN3_VOCAB_SIZE, default_cache_dir, write_qwen_tokenizer_files

logger = logging.getLogger("fp4serve.demo")

DEMO_MODEL_NAME = "fp4serve-demo-qwen3"
DEMO_DIRNAME = "demo-qwen3-v1"  # bump the suffix whenever the written bytes change
MARKER_FILE = "fp4serve_demo.json"
CHAT_TEMPLATE_RESOURCE = "qwen3_chat.jinja"
_SEED = 20_251_121
_INIT_STD = 0.02
_MAX_CHUNK = 1 << 20  # elements drawn per RNG call: bounds the float64 scratch to 8 MiB


@dataclass(frozen=True)
class DemoArchitecture:
    """The demo's shape; everything else in config.json is Qwen3's default."""

    vocab_size: int = QWEN3_VOCAB_SIZE
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6


BOS_TOKEN_ID = 151_643  # <|endoftext|>
EOS_TOKEN_ID = 151_645  # <|im_end|>


def chat_template_text() -> str:
    """fp4serve's Qwen3 chat template (engine/templates/qwen3_chat.jinja)."""
    return (resources.files("engine") / "templates" / CHAT_TEMPLATE_RESOURCE).read_text(encoding="utf-8")


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """The demo checkpoint folder, created on first use. Safe when several processes race: each
    builds in its own temp folder and renames it into place; the first rename wins."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    final = root / DEMO_DIRNAME
    if _is_complete(final):
        logger.info("demo model %s at %s", DEMO_MODEL_NAME, final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():
        if _is_complete(final):  # another process renamed its copy in since the first check
            return final
        _remove_stale(final)
    started = time.monotonic()
    logger.info("creating demo model %s at %s (first use only)", DEMO_MODEL_NAME, final)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIRNAME}.tmp-", dir=root))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; a shared FP4SERVE_CACHE must stay readable
    try:
        _write_checkpoint(staging, root)
        try:
            os.rename(staging, final)
        except OSError:
            # Another process renamed its copy first (same bytes); ours is discarded below.
            if not _is_complete(final):
                raise
            logger.info("another process created %s first; using it", final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("demo model ready in %.1f s", time.monotonic() - started)
    return final


def _write_checkpoint(dst: Path, tokenizer_cache: Path) -> None:
    arch = DemoArchitecture()
    _write_json(dst / "config.json", _config(arch))
    _write_json(dst / "generation_config.json", _generation_config())
    logger.info("writing seeded random weights (seed %d)", _SEED)
    save_file(demo_weights(arch), str(dst / "model.safetensors"), metadata={"format": "pt"})
    logger.info("writing the Qwen3 tokenizer (the first build takes about 10 s)")
    write_qwen_tokenizer_files(
        dst,
        chat_template_text(),
        model_max_length=arch.max_position_embeddings,
        cache_dir=tokenizer_cache,
    )
    # The marker goes last: a folder with a valid marker is complete.
    files = sorted(p.name for p in dst.iterdir())
    _write_json(
        dst / MARKER_FILE,
        {
            "name": DEMO_MODEL_NAME,
            "version": DEMO_DIRNAME,
            "seed": _SEED,
            "files": {name: {"bytes": (dst / name).stat().st_size, "sha256": _sha256(dst / name)} for name in files},
        },
    )


def _config(arch: DemoArchitecture) -> dict[str, object]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_position_embeddings,
        "rope_theta": arch.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": arch.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": arch.num_hidden_layers,
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": True,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    }


def _generation_config() -> dict[str, object]:
    # Qwen3's own sampling defaults, so the demo exercises the same code paths as a real Qwen3.
    return {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
        "pad_token_id": BOS_TOKEN_ID,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def _weight_shapes(arch: DemoArchitecture) -> list[tuple[str, tuple[int, ...]]]:
    """HF Qwen3 tensor names and shapes, in the order the RNG fills them. No lm_head: tied."""
    h, q_dim = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv_dim = arch.num_key_value_heads * arch.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (arch.vocab_size, h))]
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (q_dim, h)),
            (f"{p}.self_attn.k_proj.weight", (kv_dim, h)),
            (f"{p}.self_attn.v_proj.weight", (kv_dim, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q_dim)),
            (f"{p}.self_attn.q_norm.weight", (arch.head_dim,)),
            (f"{p}.self_attn.k_norm.weight", (arch.head_dim,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (arch.intermediate_size, h)),
            (f"{p}.mlp.up_proj.weight", (arch.intermediate_size, h)),
            (f"{p}.mlp.down_proj.weight", (h, arch.intermediate_size)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    return shapes


def demo_weights(arch: DemoArchitecture) -> dict[str, torch.Tensor]:
    """N(0, 0.02) matrices and all-ones norms, bf16 on CPU.

    NOTE: drawn in float64, then rounded to bf16: torch's float32 normal_ has a SIMD path chosen
    by CPU capability (ATEN_CPU_CAPABILITY=default and avx2 give different bits), the float64 one
    does not, so the bytes match across x86 machines for a given torch version.
    """
    generator = torch.Generator(device="cpu").manual_seed(_SEED)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in _weight_shapes(arch):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)  # [dim] bf16, cpu
            continue
        flat = torch.empty(math.prod(shape), dtype=torch.bfloat16)  # [numel] bf16, cpu
        for start in range(0, flat.numel(), _MAX_CHUNK):
            chunk = flat[start : start + _MAX_CHUNK]
            draw = torch.empty(chunk.numel(), dtype=torch.float64).normal_(0.0, _INIT_STD, generator=generator)
            chunk.copy_(draw)
        weights[name] = flat.view(shape)
    return weights


def _is_complete(folder: Path) -> bool:
    """True when the marker exists and every file it lists is there at its recorded size."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
        files = marker["files"]
        return marker["version"] == DEMO_DIRNAME and all(
            (folder / name).stat().st_size == entry["bytes"] for name, entry in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _remove_stale(folder: Path) -> None:
    # Only reachable by hand edits (the folder appears by an atomic rename): move it aside first
    # so a racing process never sees it half-deleted.
    logger.warning("demo model folder %s is incomplete or damaged; recreating it", folder)
    aside = folder.with_name(f".{folder.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return  # another process moved it already
    shutil.rmtree(aside, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
