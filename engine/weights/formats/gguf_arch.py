"""What each GGUF architecture means in HF terms: llama.cpp's tensor names back to the HF checkpoint
names our loader reads, the value transforms of llama.cpp's converter (convert_hf_to_gguf.py /
conversion/qwen.py) undone, and the HF config rebuilt from llama.cpp's metadata keys.

- llama: q/k rows interleaved per head (undone); qwen3: names only.
- qwen3moe (Qwen3-MoE, Qwen3-Coder-30B-A3B): experts stacked `ffn_{gate,up,down}_exps` [E, I, H] /
  [E, H, I], router `ffn_gate_inp`; written back per expert. llama.cpp always renormalizes the
  top-k, so `norm_topk_prob` is true.
- qwen35 / qwen35moe (Qwen3.5 / 3.6 hybrids, with the MoE's shared expert `*_shexp` and its gate
  `ffn_gate_inp_shexp`): zero-centred norms stored as w + 1 (not `ssm_norm`); `ssm_a` = -exp(A_log);
  `ssm_dt.bias` is dt_bias; `ssm_conv1d` squeezed to [C, K]; where there are more value heads than
  key heads, every value-head-indexed tensor (attn_qkv's V rows, attn_gate, ssm_alpha/beta, ssm_a,
  ssm_dt, ssm_conv1d's V channels, ssm_out's columns) reordered from grouped by key head to tiled;
  attn_q keeps the query and its gate interleaved per head, as HF's q_proj; the MTP block is
  `blk.{num_hidden_layers}.*` with `nextn.{eh_proj, enorm, hnorm, shared_head_norm}`.
transformers 5.24's own qwen35 GGUF loader undoes the same transforms (SubtractOne in float32,
log(-x), TiledToGroupedRows), which the tests hold us to."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# GGUF `general.architecture` -> (HF architecture, HF model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
HYBRIDS = ("qwen35", "qwen35moe")
# The architectures whose config we build from llama.cpp's keys (transformers' GGUF config
# support for them is missing or incomplete: no expert width for qwen3moe).
OWN_CONFIG = ("qwen3moe", *HYBRIDS)

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF name after `blk.N.` (without .weight/.bias) -> HF name after `model.layers.N.`
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_EXPERTS = {
    "ffn_gate_exps": ("gate",),
    "ffn_up_exps": ("up",),
    "ffn_down_exps": ("down",),
    "ffn_gate_up_exps": ("gate", "up"),
}
_NEXTN = {
    "nextn.eh_proj": "mtp.fc",
    "nextn.enorm": "mtp.pre_fc_norm_embedding",
    "nextn.hnorm": "mtp.pre_fc_norm_hidden",
    "nextn.shared_head_norm": "mtp.norm",
}
# The MTP block's copies of the shared embedding / head (llama.cpp loads them when present): the
# main model's are used.
_NEXTN_SHARED = ("nextn.embed_tokens", "nextn.shared_head_head")
# Zero-centred RMSNorm weights (stored + 1 in hybrid GGUFs).
_OFFSET_NORMS = {
    "attn_norm",
    "post_attention_norm",
    "attn_q_norm",
    "attn_k_norm",
    "output_norm",
    "nextn.enorm",
    "nextn.hnorm",
    "nextn.shared_head_norm",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class TensorMap:
    """Converts one architecture's GGUF tensors (dequantized, float32 numpy) to HF tensors."""

    arch: str
    num_layers: int  # decoder layers; blocks past them are the MTP block
    num_heads: int
    num_kv_heads: int
    num_k_heads: int = 0  # hybrids: linear-attention key heads
    num_v_heads: int = 0
    head_k_dim: int = 0
    head_v_dim: int = 0

    def known(self, gguf_name: str) -> bool:
        return self._parse(gguf_name) is not None

    def convert(self, gguf_name: str, value: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs for one GGUF tensor (experts: one per expert and projection)."""
        parsed = self._parse(gguf_name)
        assert parsed is not None, f"{gguf_name}: not a tensor of {self.arch}"
        hf, stem, block = parsed
        if hf == "":
            return  # the MTP block's copy of the shared embedding / head
        value = np.asarray(value, dtype=np.float32)
        if self.arch == "llama" and stem in ("attn_q", "attn_k"):
            value = unpermute_qk(value, self.num_heads if stem == "attn_q" else self.num_kv_heads)
        if self.arch in HYBRIDS:
            value = self._undo_hybrid(stem, value)
        if stem in _EXPERTS:
            for e in range(value.shape[0]):
                for proj, rows in zip(_EXPERTS[stem], np.split(value[e], len(_EXPERTS[stem]), axis=0)):
                    yield hf.format(e=e, proj=proj), _tensor(rows)
            return
        yield hf, _tensor(value)

    def _parse(self, gguf_name: str) -> tuple[str, str, int | None] | None:
        """(HF name template, GGUF stem without block and suffix, block) or None."""
        stem, suffix = gguf_name, ""
        for end in (".weight", ".bias"):
            if gguf_name.endswith(end):
                stem, suffix = gguf_name.removesuffix(end), end
        if stem in _TOP and suffix:
            return _TOP[stem] + suffix, stem, None
        m = _BLOCK.fullmatch(stem)
        if m is None:
            return None
        block, leaf = int(m.group(1)), m.group(2)
        hybrid = self.arch in HYBRIDS
        mtp = block >= self.num_layers
        if mtp and not hybrid:
            return None
        prefix = f"mtp.layers.{block - self.num_layers}." if mtp else f"model.layers.{block}."
        if mtp and leaf in _NEXTN and suffix == ".weight":
            return _NEXTN[leaf] + suffix, leaf, block
        if mtp and leaf in _NEXTN_SHARED:
            return "", leaf, block
        if hybrid and leaf == "ssm_a":  # llama.cpp names it without a suffix; a .weight is read too
            return prefix + "linear_attn.A_log", leaf, block
        if hybrid and leaf == "ssm_dt" and suffix:
            return prefix + "linear_attn.dt_bias", leaf, block
        if leaf in _EXPERTS and suffix == ".weight" and self.arch in ("qwen3moe", "qwen35moe"):
            return prefix + "mlp.experts.{e}.{proj}_proj.weight", leaf, block
        if leaf in _LAYER and suffix:
            return prefix + _LAYER[leaf] + suffix, leaf, block
        return None

    def _undo_hybrid(self, stem: str, value: np.ndarray) -> np.ndarray:
        if stem in _OFFSET_NORMS:
            value = value - np.float32(1.0)  # float32, as llama.cpp added it and transformers subtracts it
        elif stem == "ssm_a":
            # A_log, by torch's float32 log as transformers' LogNegate (numpy's differs in the last bit)
            value = torch.log(-torch.from_numpy(np.require(value, np.float32, ["C", "W"]))).numpy()
        elif stem == "ssm_conv1d":
            value = value.reshape(value.shape[0], 1, -1)  # llama.cpp's squeezed [C, K] -> HF's [C, 1, K]
        elif stem == "ffn_gate_inp_shexp":
            value = value.reshape(1, -1)
        if self.num_v_heads == self.num_k_heads:
            return value
        key_rows = 2 * self.num_k_heads * self.head_k_dim  # q and k of the fused qkv / conv channels
        if stem in ("attn_qkv", "ssm_conv1d"):
            value = np.concatenate([value[:key_rows], self._grouped(value[key_rows:], self.head_v_dim, 0)])
        elif stem == "attn_gate":
            value = self._grouped(value, self.head_v_dim, 0)
        elif stem in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
            value = self._grouped(value, 1, 0)
        elif stem == "ssm_out":
            value = self._grouped(value, self.head_v_dim, 1)
        return value

    def _grouped(self, value: np.ndarray, head_dim: int, axis: int) -> np.ndarray:
        """Value heads from llama.cpp's tiled order (head j of every key head, then j + 1) back to
        HF's grouped order (the heads of key head 0, then of key head 1) along `axis`."""
        per_k = self.num_v_heads // self.num_k_heads
        moved = np.moveaxis(value, axis, 0)
        rest = moved.shape[1:]
        grouped = moved.reshape(per_k, self.num_k_heads, head_dim, *rest).swapaxes(0, 1).reshape(moved.shape)
        return np.moveaxis(grouped, 0, axis)


def _tensor(value: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.require(value, np.float32, ["C", "W"]))  # a copy of read-only file memory


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's llama q/k row order (it interleaves each head's two rotary halves)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def tensor_map(arch: str, config: dict[str, Any]) -> TensorMap:
    """The map for an HF config built from this GGUF (see `own_config`)."""
    common = dict(
        arch=arch,
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
    )
    if arch not in HYBRIDS:
        return TensorMap(**common)
    return TensorMap(
        **common,
        num_k_heads=config["linear_num_key_heads"],
        num_v_heads=config["linear_num_value_heads"],
        head_k_dim=config["linear_key_head_dim"],
        head_v_dim=config["linear_value_head_dim"],
    )


def own_config(
    arch: str, field: Callable[[str], Any], tensor_shapes: dict[str, tuple[int, ...]], vocab_size: int
) -> dict[str, Any]:
    """The HF config of a qwen3moe / qwen35 / qwen35moe GGUF from llama.cpp's metadata keys;
    `field(key)` reads `{arch}.{key}` (None when absent); `tensor_shapes` (GGUF name -> numpy-order
    shape) stand in for the expert widths a file may omit."""

    def need(key: str) -> Any:
        value = field(key)
        if value is None:
            raise KeyError(f"{arch}.{key}")
        return value

    def width(key: str, tensor: str) -> int:
        """A width from its key, else from the first block's tensor (rows of gate / up)."""
        value = field(key)
        shape = tensor_shapes.get(f"blk.0.{tensor}.weight")
        if value is None and shape is not None:
            return int(shape[-2])
        return int(need(key))

    tensor_names = set(tensor_shapes)

    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    head_dim = int(field("attention.key_length") or need("embedding_length") // need("attention.head_count"))
    mtp_layers = int(field("nextn_predict_layers") or 0)
    num_layers = int(need("block_count")) - mtp_layers
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": int(need("attention.head_count")),
        "num_key_value_heads": int(field("attention.head_count_kv") or need("attention.head_count")),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(need("context_length")),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(field("rope.freq_base") or 10000.0)}
    if field("feed_forward_length") is not None:
        config["intermediate_size"] = int(field("feed_forward_length"))
    if arch in ("qwen3moe", "qwen35moe"):
        config.update(
            num_experts=int(need("expert_count")),
            num_experts_per_tok=int(need("expert_used_count")),
            moe_intermediate_size=width("expert_feed_forward_length", "ffn_up_exps"),
        )
    if arch == "qwen3moe":
        # llama.cpp's qwen3moe graph renormalizes the top-k weights whatever the source config said
        # (its converter writes no flag); a file that states expert_weights_norm is taken at its word.
        norm = field("expert_weights_norm")
        config.update(norm_topk_prob=True if norm is None else bool(norm), decoder_sparse_step=1, mlp_only_layers=[])
        config.setdefault("intermediate_size", config["moe_intermediate_size"])
    if arch in HYBRIDS:
        value_heads = int(need("ssm.time_step_rank"))
        interval = int(field("full_attention_interval") or 4)
        config.update(
            linear_conv_kernel_dim=int(need("ssm.conv_kernel")),
            linear_key_head_dim=int(need("ssm.state_size")),
            linear_num_key_heads=int(need("ssm.group_count")),
            linear_num_value_heads=value_heads,
            linear_value_head_dim=int(need("ssm.inner_size")) // value_heads,
            full_attention_interval=interval,
            layer_types=[
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
            ],
        )
        rope["partial_rotary_factor"] = int(field("rope.dimension_count") or head_dim // 4) / head_dim
        sections = [s for s in (field("rope.dimension_sections") or []) if s]
        if sections:
            rope.update(mrope_section=sections, mrope_interleaved=True)
        if mtp_layers:
            config["mtp_num_hidden_layers"] = mtp_layers
    if arch == "qwen35moe":
        config["shared_expert_intermediate_size"] = width("expert_shared_feed_forward_length", "ffn_up_shexp")
    config["rope_parameters"] = rope
    return config
