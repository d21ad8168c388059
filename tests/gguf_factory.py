"""Tiny GGUF files for tests, written with the `gguf` package the way llama.cpp's converter writes
them (llama q/k rows permuted, ggml tensor names), from a tiny HF checkpoint folder, with a small
byte-level BPE tokenizer and a ChatML template in the metadata."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
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


def write_gguf(
    ckpt: Path, dst: Path, arch: str | None = None, quant: str | None = None, raw_types: dict[str, str] | None = None
) -> Path:
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
    _add_tokenizer(writer, cfg["vocab_size"])
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


def _add_tokenizer(writer: Any, vocab_size: int) -> None:
    tokens, merges = byte_level_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def _gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.{suffix}"


# --- MoE and hybrid architectures, written by llama.cpp's converter's rules ----------------------
# convert_hf_to_gguf.py (conversion/qwen.py): Qwen3MoeModel and Qwen2MoeModel stack the experts;
# Qwen3_5TextModel / Qwen3_5MoeTextModel add, in method-resolution order, the MTP renaming
# (_Qwen35MtpMixin), the value-head reorder (_LinearAttentionVReorderBase) and Qwen3NextModel's
# value transforms; TextModel maps names with the gguf package's TensorNameMap. Nothing here is
# shared with engine/weights/formats/gguf_arch.py, which undoes all of it.

LLAMACPP_ARCH = {
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Qwen3_5ForCausalLM": "qwen35",
    "Qwen3_5ForConditionalGeneration": "qwen35",
    "Qwen3_5MoeForCausalLM": "qwen35moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen35moe",
}
_MTP_OWN = {
    "mtp.fc": "NEXTN_EH_PROJ",
    "mtp.pre_fc_norm_embedding": "NEXTN_ENORM",
    "mtp.pre_fc_norm_hidden": "NEXTN_HNORM",
    "mtp.norm": "NEXTN_SHARED_HEAD_NORM",
}


def write_llamacpp_gguf(ckpt: Path, dst: Path, quant: str | None = None) -> Path:
    """`ckpt` (a Qwen3-MoE or Qwen3.5/3.6 (MoE) HF folder from tests/factories.py) as llama.cpp's
    converter writes it. `quant` ("Q8_0", ...) quantizes the 2-D and 3-D weights as llama-quantize
    would (norms, conv1d, ssm_a/ssm_dt and routers stay F32 here)."""
    import gguf
    import torch
    from safetensors.torch import load_file as load_torch

    raw = json.loads((ckpt / "config.json").read_text())
    hp = {**raw, **raw.get("text_config", {})}  # llama.cpp reads a ConditionalGeneration's text config
    arch = LLAMACPP_ARCH[raw["architectures"][0]]
    tensors = {
        n.replace("model.language_model.", "model."): t
        for n, t in load_torch(str(ckpt / "model.safetensors")).items()
        if not n.startswith("model.visual.")
    }
    n_layer = hp["num_hidden_layers"]
    n_mtp = hp.get("mtp_num_hidden_layers") or int(any(n.startswith("mtp.") for n in tensors))
    block_count = n_layer + (n_mtp if arch != "qwen3moe" else 0)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], block_count)
    writer = gguf.GGUFWriter(str(dst), arch)
    _llamacpp_metadata(writer, arch, hp, block_count, n_mtp)
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        for out_name, out in _llamacpp_tensors(arch, hp, name, value.float(), experts):
            if out_name in _MTP_OWN.values():
                gguf_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[out_name]].format(bid=n_layer) + ".weight"
            else:
                gguf_name = name_map.get_name(out_name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, f"no GGUF name for {out_name}"
            data = out.numpy()
            qtype = gguf.GGMLQuantizationType[quant] if quant is not None else None
            # llama-quantize leaves rows that are not whole quant blocks (here 48-wide) in float
            if (
                qtype is not None
                and data.ndim >= 2
                and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
                and not gguf_name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
            ):
                writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, data)
    assert all(not parts for parts in experts.values()), "unprocessed experts"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _llamacpp_metadata(writer: Any, arch: str, hp: dict[str, Any], block_count: int, n_mtp: int) -> None:
    rope = hp.get("rope_parameters") or {}
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(block_count)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:
        writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", hp.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("num_local_experts") or hp.get("num_experts"):
        writer.add_expert_count(hp.get("num_local_experts") or hp["num_experts"])
        writer.add_expert_used_count(hp["num_experts_per_tok"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    writer.add_file_type(gguf_file_type())
    if hp.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("shared_expert_intermediate_size") is not None:
        writer.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    if arch in ("qwen35", "qwen35moe"):
        writer.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(hp["linear_key_head_dim"])
        writer.add_ssm_group_count(hp["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(hp["linear_num_value_heads"])
        writer.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
        writer.add_full_attention_interval(hp.get("full_attention_interval", 4))
        # NOTE: llama.cpp reads partial_rotary_factor from the top-level hparams (0.25 when absent)
        writer.add_rope_dimension_count(int(hp["head_dim"] * hp.get("partial_rotary_factor", 0.25)))
        writer.add_rope_dimension_sections([11, 11, 10, 0])  # _Qwen35MRopeMixin's default
        if n_mtp:
            writer.add_nextn_predict_layers(n_mtp)
    writer.add_vocab_size(hp["vocab_size"])
    _add_tokenizer(writer, hp["vocab_size"])


def gguf_file_type() -> int:
    import gguf

    return int(gguf.LlamaFileType.ALL_F32)


def _tiled(t: Any, dim: int, num_k: int, per_k: int, head_dim: int) -> Any:
    """_LinearAttentionVReorderBase._reorder_v_heads: grouped by key head -> tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], num_k, per_k, head_dim, *shape[dim + 1 :])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def _llamacpp_tensors(
    arch: str, hp: dict[str, Any], name: str, t: Any, experts: dict[int, dict[str, Any]]
) -> list[tuple[str, Any]]:
    import torch

    if arch in ("qwen35", "qwen35moe"):
        n_layer = hp["num_hidden_layers"]
        if name.startswith("mtp.layers."):  # _Qwen35MtpMixin
            bid = int(name.split(".")[2])
            name = name.replace(f"mtp.layers.{bid}", f"model.layers.{bid + n_layer}")
        elif name.startswith("mtp."):
            stem = name.removesuffix(".weight")  # Qwen3NextModel adds 1 to every norm.weight, not to fc
            return [(_MTP_OWN[stem], t if stem == "mtp.fc" else t + 1)]
        num_k, num_v = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
        hk, hv, per_k = hp["linear_key_head_dim"], hp["linear_value_head_dim"], num_v // num_k
        if num_k != num_v and "linear_attn." in name:  # _LinearAttentionVReorderBase
            if ".in_proj_qkv." in name:
                t = torch.cat([t[: 2 * hk * num_k], _tiled(t[2 * hk * num_k :], 0, num_k, per_k, hv)])
            elif ".in_proj_z." in name:
                t = _tiled(t, 0, num_k, per_k, hv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                t = _tiled(t, 0, num_k, per_k, 1)
            elif ".A_log" in name or ".dt_bias" in name:
                t = _tiled(t.unsqueeze(-1), 0, num_k, per_k, 1).squeeze(-1)
            elif ".conv1d" in name:
                data = t.squeeze()
                t = torch.cat([data[: 2 * hk * num_k], _tiled(data[2 * hk * num_k :], 0, num_k, per_k, hv)])
            elif ".out_proj." in name:
                t = _tiled(t, 1, num_k, per_k, hv)
        if name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
    m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$", name)
    if m is None:
        return [(name, t)]
    bid = int(m.group(1))  # Qwen2MoeModel: merge the experts once all 3 * E have arrived
    experts.setdefault(bid, {})[name] = t
    n_experts = hp.get("num_local_experts") or hp["num_experts"]  # find_hparam's order
    if len(experts[bid]) < 3 * n_experts:
        return []
    out = []
    for w_name in ("down_proj", "gate_proj", "up_proj"):
        stacked = torch.stack(
            [experts[bid].pop(f"model.layers.{bid}.mlp.experts.{e}.{w_name}.weight") for e in range(n_experts)]
        )
        out.append((f"model.layers.{bid}.mlp.experts.{w_name}.weight", stacked))
    return out
