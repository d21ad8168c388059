"""The text path of Qwen3.5 / Qwen3.6 hybrids: layers of Gated DeltaNet (a recurrent state per
sequence, kept in state slots) and of gated attention (the paged KV cache), each followed by an MLP.

Forwards take everything explicitly, as the dense decoder does: the attention layers get their KV
cache and the attention backend; the DeltaNet layers get the linear-attention backend, which holds
this step's per-sequence segments and the state slots. The MLP of a layer comes from `mlp_factory`,
so a mixture-of-experts block can take its place (Qwen3.5-MoE).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.hybrid_backend import HybridBackend
from engine.attention.linear_attention import LinearAttentionBackend
from engine.models.decoder import MLP, DecoderForCausalLM
from engine.models.layers import Linear, RotaryEmbedding, embedding
from engine.weights.config.hybrid_config import LINEAR_ATTENTION
from engine.weights.config.model_config import ModelConfig

MLPFactory = Callable[[ModelConfig, int], nn.Module]  # (config, layer index) -> the layer's MLP


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with weight 1 + w (Qwen3.5 stores w around 0), computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * SiLU(gate) over each DeltaNet value head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


class _ConvWeight(nn.Module):
    """Holds the depthwise conv's weight [C, 1, K] under the checkpoint's name (conv1d.weight)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_index: int) -> None:
        super().__init__()
        h = cfg.hybrid
        assert h is not None, "GatedDeltaNet needs a hybrid config"
        self.linear_index = linear_index  # this layer's index among the DeltaNet layers (its state)
        self.num_k_heads, self.num_v_heads = h.num_k_heads, h.num_v_heads
        self.head_k_dim, self.head_v_dim = h.head_k_dim, h.head_v_dim
        self.sizes = [h.key_dim, h.key_dim, h.value_dim]  # q, k, v inside the conv channels
        # in_proj_qkv and in_proj_z fused (both NVFP4-able); b and a fused, kept in float: their
        # 2 * v_heads outputs are ~0.5% of the layer's weights and set the decay and write rate.
        self.in_proj_qkvz = Linear(cfg.hidden_size, [h.conv_dim, h.value_dim])
        self.in_proj_ba = Linear(cfg.hidden_size, [h.num_v_heads, h.num_v_heads])
        self.conv1d = _ConvWeight(h.conv_dim, h.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(h.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(h.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(h.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(h.value_dim, [cfg.hidden_size])
        self.conv_dim, self.value_dim = h.conv_dim, h.value_dim

    def forward(self, x: torch.Tensor, linear: LinearAttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([self.num_v_heads, self.num_v_heads], dim=-1)
        mixed = linear.conv(self.linear_index, qkv, self.conv1d.weight[:, 0, :])  # [T, conv_dim]
        q, k, v = mixed.split(self.sizes, dim=-1)
        q = q.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()  # [T, Hv] write rate
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv] log decay, float32
        out = linear.delta_rule(self.linear_index, q, k, v, g, beta)  # [T, Hv, Dv]
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_dim))


class GatedAttention(nn.Module):
    """Attention with q/k RMSNorm, partial RoPE and a sigmoid output gate (q_proj emits, per head,
    the query and then its gate)."""

    def __init__(self, cfg: ModelConfig, kv_index: int) -> None:
        super().__init__()
        self.kv_index = kv_index  # this layer's KV cache among the attention layers
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_sizes = [2 * q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, self.qkv_sizes, bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, [cfg.hidden_size], bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        backend: HybridBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)  # [T, Hq, D]
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        rd = self.rotary_dim
        q_rot, k_rot = rotary(q[..., :rd], k[..., :rd], positions)
        q = torch.cat([q_rot, q[..., rd:]], dim=-1)
        k = torch.cat([k_rot, k[..., rd:]], dim=-1)
        out = backend.forward(q, k, v, kv_cache).reshape(num_tokens, -1)  # [T, Hq * D]
        return self.o_proj(out * torch.sigmoid(gate.reshape(num_tokens, -1)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The checkpoint's names: linear_attn.* for DeltaNet layers, self_attn.* for attention.
        self.linear_attn = mixer if isinstance(mixer, GatedDeltaNet) else None
        self.self_attn = mixer if isinstance(mixer, GatedAttention) else None
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_caches: list[torch.Tensor],
        backend: HybridBackend,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            h = self.linear_attn(h, backend.linear)
        else:
            assert self.self_attn is not None
            h = self.self_attn(h, positions, rotary, kv_caches[self.self_attn.kv_index], backend)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


def dense_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    return MLP(cfg)


class HybridForCausalLM(DecoderForCausalLM):
    """Embeddings, the hybrid layers, final norm, lm_head. Shares the dense decoder's lm_head
    handling (keep_transposed_lm_head, compute_logits) by subclassing it."""

    def __init__(self, cfg: ModelConfig, max_len: int, mlp_factory: MLPFactory = dense_mlp) -> None:
        # NOTE: not DecoderForCausalLM.__init__: that builds dense layers; the attributes below
        # are the ones its methods read (config, lm_head, lm_head_t).
        nn.Module.__init__(self)
        h = cfg.hybrid
        assert h is not None, "HybridForCausalLM needs a hybrid config"
        self.config = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = []
        num_linear = num_attn = 0
        for i, kind in enumerate(h.layer_types):
            if kind == LINEAR_ATTENTION:
                mixer: nn.Module = GatedDeltaNet(cfg, num_linear)
                num_linear += 1
            else:
                mixer = GatedAttention(cfg, num_attn)
                num_attn += 1
            layers.append(HybridDecoderLayer(cfg, i, mixer, mlp_factory(cfg, i)))
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings, max_len)
        self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size])
        self.lm_head_t: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per attention layer, in layer order
        backend: HybridBackend,  # type: ignore[override]
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rotary, kv_caches, backend)
        return self.norm(x)
