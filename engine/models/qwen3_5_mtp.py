"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3.6 checkpoints (`mtp.*` tensors), used
as a speculative drafter (engine/spec_decode/mtp.py).

Row i of an MTP forward sits at the target's position i and sees two things: the target's hidden
state at position i (after the main model's final norm) and the embedding of the token at position
i + 1. It predicts the token at position i + 2:

    x = fc(concat(pre_fc_norm_embedding(embed(token[i + 1])), pre_fc_norm_hidden(hidden[i])))
    h = norm(layer(x, position i))           layer: one gated-attention decoder layer + MLP
    logits = lm_head(h)                      embed_tokens and lm_head are the main model's

Its attention layer has its own K/V at every position (filled as the target computes tokens). A
chain of drafts feeds `h` back as the next row's hidden state, one position further on. Layout and
maths as in vLLM's Qwen3.5 / Qwen3-Next MTP model files (read, not copied)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention.hybrid_backend import HybridBackend
from engine.models.layers import Linear, RotaryEmbedding
from engine.models.qwen3_5 import GatedAttention, HybridDecoderLayer, MLPFactory, ZeroCenteredRMSNorm
from engine.weights.config.model_config import ModelConfig

MTP_PREFIX = "mtp."
# mtp.* tensors outside its decoder layer: checkpoint name -> (our parameter path, shard)
_OWN_TENSORS: dict[str, tuple[str, int | None]] = {
    "mtp.fc.weight": ("mtp.fc.weight", 0),
    "mtp.norm.weight": ("mtp.norm.weight", None),
    "mtp.pre_fc_norm_embedding.weight": ("mtp.pre_fc_norm_embedding.weight", None),
    "mtp.pre_fc_norm_hidden.weight": ("mtp.pre_fc_norm_hidden.weight", None),
}


class Qwen3_5MTP(nn.Module):
    """`mtp.*` of a Qwen3.5 checkpoint: two input norms, fc, one full-attention layer, final norm.
    Its attention layer's KV cache is the one passed to `forward` (kv_index 0)."""

    def __init__(self, cfg: ModelConfig, mlp_factory: MLPFactory) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(cfg.hidden_size, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(cfg.hidden_size, eps)
        self.fc = Linear(2 * cfg.hidden_size, [cfg.hidden_size])
        # The layer index only picks the MLP kind: the MTP layer comes after the main model's.
        self.layers = nn.ModuleList(
            [HybridDecoderLayer(cfg, cfg.num_layers, GatedAttention(cfg, 0), mlp_factory(cfg, cfg.num_layers))]
        )
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, eps)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, hidden]: embed_tokens(token at position + 1)
        hidden: torch.Tensor,  # [T, hidden]: the target's (or the previous MTP step's) hidden state
        positions: torch.Tensor,  # [T] int64
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # the MTP layer's paged KV cache
        backend: HybridBackend,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after mtp.norm (what lm_head scores and the next draft step reads)."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        x = self.layers[0](x, positions, rotary, [kv_cache], backend)
        return self.norm(x)


def map_mtp_name(
    name: str, map_layer_name: Callable[[str], tuple[str, int | None] | None]
) -> tuple[str, int | None] | None:
    """mtp.* checkpoint name -> (our parameter path under `mtp.`, shard) or None (unused).
    `map_layer_name` maps a main-model name (model.layers.N.*) the same way the loader does."""
    if name in _OWN_TENSORS:
        return _OWN_TENSORS[name]
    if not name.startswith(MTP_PREFIX + "layers.0."):
        return None
    mapped = map_layer_name("model." + name.removeprefix(MTP_PREFIX))
    return None if mapped is None else ("mtp." + mapped[0], mapped[1])
