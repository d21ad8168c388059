"""Tiny GGUF files for tests, written with the `gguf` package the way llama.cpp's converter writes
them (llama q/k rows permuted, ggml tensor names), from a tiny HF checkpoint folder, with a small
byte-level BPE tokenizer and a ChatML template in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """GPT-2's 256 byte symbols, then two-letter merges, then the ChatML specials last."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    merges = []
    for a in letters:
        for b in letters:
            if len(tokens) == vocab_size - len(SPECIAL_TOKENS):
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    return tokens + list(SPECIAL_TOKENS), merges


def permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py row order for llama q/k."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(ckpt: Path, dst: Path, arch: str | None = None, quant: str | None = None,
               raw_types: dict[str, str] | None = None) -> Path:
    """`ckpt` (an HF folder from tests/factories.py) as a GGUF file at `dst`. `quant` ("Q8_0",
    "Q4_1", ...) quantizes the 2-D linears; `raw_types` writes named tensors' bytes as another type."""
    import gguf

    cfg = json.loads((ckpt / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = arch or model_type
    writer = gguf.GGUFWriter(str(dst), arch)
    writer.add_name(f"tiny-{model_type}")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    tokens, merges = byte_level_vocab(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, value in load_file(str(ckpt / "model.safetensors")).items():
        gguf_name = _gguf_name(name)
        value = value.astype(np.float32)
        if model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = permute_qk(value, cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"])
        if raw_types and gguf_name in raw_types:
            qtype = gguf.GGMLQuantizationType[raw_types[gguf_name]]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((value.shape[0], value.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
        elif quant is not None and value.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.{suffix}"
