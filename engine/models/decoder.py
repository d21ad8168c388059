"""The dense decoder of Qwen3 and the Llama 3 family (they differ only in Qwen3's q/k RMSNorm
and in optional biases): embeddings, N x (attention + SwiGLU MLP), final norm, lm_head.

Everything is passed explicitly: token ids, positions, the per-layer KV caches and the
attention backend planned for this step. q/k/v and gate/up are fused linears; the loader swaps
any linear for an `NVFP4Linear` (kernels/), so forwards use only `linear(x)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.cpu_paged import CpuAttentionBackend
from engine.host import cpu_threads
from engine.host.cpu_threads import serial_cpu_ops
from engine.models.layers import Linear, PositionedRotary, RMSNorm, RotaryEmbedding, embedding, kernels_only
from engine.models.moe import SparseMoeBlock
from engine.weights.config.model_config import ModelConfig
from kernels import cpu_decode_layer, cpu_elementwise


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_sizes = [q_size, kv_size, kv_size]  # kept here: qkv_proj may be swapped for NVFP4
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, [cfg.hidden_size], bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T] int64
        rotary: RotaryEmbedding | PositionedRotary,
        kv_cache: torch.Tensor,  # [num_pages, 2, block_size, Hkv, D]
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        q_size, kv_size, _ = self.qkv_sizes
        if self.q_norm is None and isinstance(rotary, PositionedRotary):
            # The CPU backend's one op for RoPE, the cache write and the attention (decode steps).
            attend_qkv = getattr(backend, "attend_qkv", None) if rotary.cpu_ops else None
            out = (
                attend_qkv(qkv, rotary.cos_rows, rotary.signed_sin_rows, kv_cache, self.num_heads)
                if attend_qkv is not None
                else None
            )
            if out is not None:
                return self.o_proj(out)
            # q and k are adjacent columns: one rotation of both heads' sets together.
            qk = rotary.rotate(qkv[:, : q_size + kv_size].view(num_tokens, -1, self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(q, k, positions)
        out = backend.forward(q, k, v, kv_cache)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, [cfg.hidden_size], bias=cfg.mlp_bias)
        self.cpu_ops = False  # silu(gate) * up as one C++ op (use_cpu_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops:
            return self.down_proj(cpu_elementwise.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        with serial_cpu_ops(x.device.type == "cpu" and x.shape[0] <= cpu_threads.SERIAL_ELEMENTWISE_TOKENS):
            h = F.silu(gate).mul_(up)  # silu's output is ours to write
        return self.down_proj(h)


def use_cpu_ops(model: nn.Module) -> int:
    """Run the dense decoder's norms, residual-add-and-norm, SwiGLU activation and RoPE through the
    fused C++ ops of kernels/cpu_elementwise.py (loaded by engine/host/cpu_kernels.py): one op each
    where eager torch runs 2-7. How many modules switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, MLP, DecoderLayer, DecoderForCausalLM)):
            module.cpu_ops = True
            switched += 1
    return switched


def use_fused_layers(model: nn.Module) -> int:
    """Run each dense layer whose four linears are plain int4 kernels (no bias, no padding) and
    whose attention has no q/k norm as one C++ op (kernels/cpu_decode_layer.cpp) for inputs below
    the rows where the linears switch to their dense copies; after `use_cpu_ops`. How many layers."""
    switched = 0
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer) or not layer.cpu_ops or layer.self_attn.q_norm is not None:
            continue
        linears = (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            getattr(layer.mlp, "gate_up_proj", None),
            getattr(layer.mlp, "down_proj", None),
        )
        kernels = [getattr(m, "kernel_weights", lambda: None)() for m in linears]
        if any(k is None for k in kernels) or len({(m.group_size, m.own_kernel) for m in linears}) != 1:
            continue
        below = [k[2] for k in kernels if k is not None and k[2]]
        layer.fused_weights = tuple(t for k in kernels if k is not None for t in k[:2])
        layer.fused_group_size = layer.self_attn.qkv_proj.group_size
        layer.fused_own_kernel = layer.self_attn.qkv_proj.own_kernel
        layer.fused_below_rows = min(below) if below else 1 << 30
        switched += 1
    return switched


def make_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """The MLP slot of layer `layer_idx`: a sparse MoE block where the config says so, else dense."""
    if cfg.moe is not None and cfg.moe.is_moe_layer(layer_idx):
        return SparseMoeBlock(cfg.hidden_size, cfg.moe)
    return MLP(cfg)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, layer_idx)
        self.cpu_ops = False  # the residual add and the post-attention norm as one C++ op (use_cpu_ops)
        # The int4 weights (packed codes, scales and zeros of qkv, o, gate_up, down) for the one-op
        # layer of kernels/cpu_decode_layer.cpp, for inputs of fewer than `fused_below_rows` rows
        # (use_fused_layers); None: the modules run one by one.
        self.fused_weights: tuple[torch.Tensor, ...] | None = None
        self.fused_group_size = 0
        self.fused_own_kernel = False  # the codes in our int4 op's layout (Int4Linear.own_kernel)
        self.fused_below_rows = 0

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding | PositionedRotary,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        if (
            self.fused_weights is not None
            and (x.shape[0] < self.fused_below_rows or kernels_only())
            and isinstance(rotary, PositionedRotary)
        ):
            meta = backend.decode_meta() if isinstance(backend, CpuAttentionBackend) else None
            if meta is not None:
                return cpu_decode_layer.decode_layer_int4(
                    x,
                    self.input_layernorm.weight,
                    self.post_attention_layernorm.weight,
                    self.input_layernorm.eps,
                    self.fused_weights,
                    self.fused_group_size,
                    rotary.cos_rows,
                    rotary.signed_sin_rows,
                    kv_cache,
                    meta,
                    self.self_attn.num_heads,
                    backend.scale,
                    self.fused_own_kernel,
                )
        attn = self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, backend)
        if self.cpu_ops:
            norm = self.post_attention_layernorm
            x, h = cpu_elementwise.add_rms_norm(attn, x, norm.weight, norm.eps)
            return x + self.mlp(h)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, max_len)
        # With tied embeddings lm_head shares embed_tokens' weight (set by the loader).
        self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size])
        self.lm_head_t: torch.Tensor | None = None  # see keep_transposed_lm_head
        self.cpu_ops = False  # RoPE by the C++ op (use_cpu_ops)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        rotary = self.rotary.at(positions, x.dtype, self.cpu_ops)  # cos/sin gathered once for all layers
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, rotary, kv_cache, backend)
        return self.norm(x)

    def keep_transposed_lm_head(self) -> None:
        """Keep a contiguous [hidden, vocab] copy of the lm_head weight for compute_logits.

        NOTE: for CPUs. The [S, hidden] x [hidden, vocab] matmul dominates a small model's
        step, and MKL runs it ~1.5x faster from the transposed copy than from W.T (74 vs 114 ms
        for the demo model at S=32 on an AVX2 CPU). Costs one more copy of the weight."""
        head = self.lm_head
        if isinstance(head, Linear) and head.bias is None:
            self.lm_head_t = head.weight.detach().t().contiguous()  # [hidden, vocab], model dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab] float32."""
        if self.lm_head_t is not None:
            return (hidden @ self.lm_head_t).float()
        return self.lm_head(hidden).float()
