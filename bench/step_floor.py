"""The HBM floor of one decode step (bench/gpu.py): the bytes a step of B sequences with C tokens of
context must move, counted from the model the engine loaded: its weights as stored, the experts B
tokens can reach, each sequence's KV, and each sequence's DeltaNet state. engine/ is imported inside
functions (bench/ layering rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepBytes:
    weights: int  # every linear but the experts (codes and scales as stored), norms, router, lm_head
    experts: int  # the expected bytes of the experts B tokens x top-k touch, all MoE layers
    kv: int  # each sequence's K and V over its context, every attention layer
    state: int  # each sequence's DeltaNet conv + recurrent state, read and written back

    @property
    def total(self) -> int:
        return self.weights + self.experts + self.kv + self.state


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """How many of `num_experts` experts `num_tokens` tokens routing to `top_k` distinct experts each
    touch, on average. Taking each token's choice as uniform and independent of the other tokens',
    a given expert is missed by one token with probability 1 - k/E, so by all B with (1 - k/E)^B:
    E * (1 - (1 - k/E)^B) experts are touched (exactly k at B = 1, approaching E as B grows).
    NOTE: random weights route close to uniformly; a trained router's skew touches fewer, so on a
    real checkpoint this floor is a little high."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True)
class StepFloor:
    """What one decode step reads, per model: fixed bytes, per-expert bytes, per-token KV bytes and
    per-sequence state bytes."""

    weights: int
    expert_bytes: tuple[int, ...]  # per MoE layer: one expert's weights (codes and scales as stored)
    num_experts: int
    top_k: int
    kv_bytes_per_token: int
    state_bytes_per_seq: int

    @staticmethod
    def from_runner(runner: Any) -> StepFloor:
        """From a loaded `engine.model_runner.ModelRunner`: its resident weight bytes (NVFP4 codes and
        scales, float weights, oneDNN-packed copies on CPU) less the embedding table, of which a step
        reads only its tokens' rows, and less the experts, which a step reads only where routed."""
        from engine.model_runner import kv_bytes_per_token
        from engine.models.moe import Experts, NVFP4Experts

        model, cfg = runner.model, runner.model_config
        experts = [m for m in model.modules() if isinstance(m, (Experts, NVFP4Experts))]
        per_layer = [m.weight_nbytes if isinstance(m, NVFP4Experts) else m.w13.nbytes + m.w2.nbytes for m in experts]
        embed = 0 if cfg.tie_word_embeddings else model.embed_tokens.weight.nbytes  # tied: it is the lm_head
        moe = cfg.moe
        return StepFloor(
            weights=runner.weight_nbytes - embed - sum(per_layer),
            expert_bytes=tuple(b // m.num_experts for b, m in zip(per_layer, experts)),
            num_experts=moe.num_experts if moe is not None else 0,
            top_k=moe.num_experts_per_tok if moe is not None else 0,
            kv_bytes_per_token=kv_bytes_per_token(cfg, runner.kv_dtype),
            # float32 conv + recurrent state over every DeltaNet layer: read, updated, written back
            state_bytes_per_seq=2 * cfg.hybrid.state_bytes_per_slot() if cfg.hybrid is not None else 0,
        )

    def step_bytes(self, batch_size: int, context: int) -> StepBytes:
        """One decode step of `batch_size` sequences, each with `context` tokens already in its KV."""
        touched = expected_distinct_experts(self.num_experts, self.top_k, batch_size) if self.expert_bytes else 0.0
        return StepBytes(
            weights=self.weights,
            experts=round(touched * sum(self.expert_bytes)),
            kv=batch_size * (context + 1) * self.kv_bytes_per_token,  # the new token's K/V is written too
            state=batch_size * self.state_bytes_per_seq,
        )
