"""The logits processors (vLLM's, in its order: penalties, top-k/top-p, min-p), and sampling with
static shapes and no host sync for a step whose rows all run the same ops: every row goes through
penalties, temperature, top-k/top-p and min-p (a neutral parameter is an exact
no-op), and the draw is an exponential race whose noise is a counter-based hash of (seed, output
position, token id), so a seeded row needs no generator and the whole function can run inside a
CUDA graph. engine/sampler.py applies the same processors; greedy rows are the argmax of the same
processed logits, so their ids are bit-identical to the Sampler's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.cpu_elementwise import argmax_rows
from kernels.cpu_ops import ops_loaded

_SAMPLING_EPS = 1e-5  # as engine/sampler.py: temperatures below it sample greedily
_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2^31: a 32-bit value times one stays inside int64 (no overflow).
_MUL1, _MUL2, _MUL3 = 0x7FEB352D, 0x2C1B3C6D, 0x297A2D39


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties, in its order, out of place.

    logits [P, V] f32; output_counts [P, V] int (this request's sampled tokens); prompt_mask
    [P, V] bool; presence / frequency / repetition [P] f32. Repetition covers prompt and
    output tokens (positive logits divided, others multiplied); frequency and presence only
    count output tokens.
    """
    in_output = output_counts > 0
    rep = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | in_output, penalized, logits)
    logits = logits - frequency[:, None] * output_counts.to(logits.dtype)
    return logits - presence[:, None] * in_output.to(logits.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> torch.Tensor:
    """Keep each row's top-k tokens (top_k [R] int, 0 = all), then the smallest prefix of those
    whose renormalized mass reaches top_p ([R] f32, 1.0 = all; None: no row uses top-p, which
    skips the softmax); the rest become -inf.

    One descending sort of logits [R, V] f32; with `max_top_k` (known on the host: every row's
    top_k is in 1..max_top_k), only the max_top_k largest of each row, a partial selection that
    costs a small fraction of the sort on a 150k vocabulary; with top-p on a CPU and a large
    vocabulary, first the TOP_P_CANDIDATES largest (`_top_p_from_candidates`). NOTE: the cut is a logit threshold,
    so tokens tied with the last kept one are kept too (as vLLM's top-k).
    """
    num_rows, vocab_size = logits.shape
    if max_top_k is not None and 0 < max_top_k < vocab_size:
        sorted_logits = logits.topk(max_top_k, dim=-1).values  # [R, max_top_k], descending
    else:
        if top_p is not None and logits.device.type == "cpu" and vocab_size > 8 * TOP_P_CANDIDATES:
            kept = _top_p_from_candidates(logits, top_k, top_p)
            if kept is not None:
                return kept
        sorted_logits = logits.sort(dim=-1, descending=True).values  # [R, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)  # [R] int64
    num_keep = k
    if top_p is not None:
        in_top_k = torch.arange(sorted_logits.shape[1], device=logits.device)[None, :] < k[:, None]
        probs = sorted_logits.masked_fill(~in_top_k, -math.inf).softmax(dim=-1)
        # Mass strictly before each position: a shifted cumsum stays monotone (cumsum - probs
        # need not), so the kept set is a prefix and its size is a count.
        mass_before = torch.cat([probs.new_zeros(num_rows, 1), probs.cumsum(dim=-1)[:, :-1]], dim=-1)
        keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
        num_keep = keep.sum(dim=-1)
    threshold = sorted_logits.gather(1, (num_keep - 1)[:, None])  # [R, 1]
    return logits.masked_fill(logits < threshold, -math.inf)


# Top-p on CPU first looks for each row's nucleus among its this many largest logits.
TOP_P_CANDIDATES = 1024


def _top_p_from_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """apply_top_k_top_p for rows whose kept set lies within their TOP_P_CANDIDATES largest logits,
    found by a partial selection instead of sorting the vocabulary (on a 150k vocabulary the sort is
    most of a sampled CPU step); None when some row's may not (a flat distribution, or a top_k
    above the candidates), and the caller sorts. The probabilities are the softmax over the whole
    row (or over its top-k), so the kept set is the one the sort finds, up to float summation order.
    CPU only: the check reads the tensors on the host."""
    num_rows, vocab_size = logits.shape
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)  # [R]
    whole = k >= vocab_size  # rows whose top-p runs over the whole vocabulary
    if bool(((k > TOP_P_CANDIDATES) & ~whole).any()):
        return None
    keep_all = top_p >= 1.0
    log_whole = logits.logsumexp(dim=-1)  # [R]
    # The candidates hold at most TOP_P_CANDIDATES times the top probability: where that falls short
    # of top_p (a flat row) the nucleus is past them, known before the partial selection is paid for.
    top_prob = (logits.amax(dim=-1) - log_whole).exp()
    if bool((whole & ~keep_all & (top_prob * TOP_P_CANDIDATES < top_p)).any()):
        return None
    cand = logits.topk(TOP_P_CANDIDATES, dim=-1).values  # [R, C], descending
    in_top_k = torch.arange(TOP_P_CANDIDATES, device=logits.device)[None, :] < k[:, None]
    log_total = torch.where(whole, log_whole, cand.masked_fill(~in_top_k, -math.inf).logsumexp(dim=-1))
    probs = (cand - log_total[:, None]).exp().masked_fill(~in_top_k, 0.0)  # [R, C]
    mass = probs.cumsum(dim=-1)
    if bool((whole & ~keep_all & (mass[:, -1] < top_p)).any()):
        return None  # a nucleus reaching past the candidates
    mass_before = torch.cat([probs.new_zeros(num_rows, 1), mass[:, :-1]], dim=-1)
    keep = in_top_k & ((mass_before < top_p[:, None]) | keep_all[:, None])
    threshold = cand.gather(1, (keep.sum(dim=-1) - 1)[:, None])  # [R, 1]
    threshold = threshold.masked_fill((whole & keep_all)[:, None], -math.inf)
    return logits.masked_fill(logits < threshold, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p ([R] f32) times the row's top probability.

    In logit space: p_i < min_p * p_max  <=>  l_i < l_max + ln(min_p), so no softmax, and the
    result does not depend on whether top-k/top-p renormalized the row first.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < threshold, -math.inf)


def greedy_ids(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] f32 -> int64 [B], each row's argmax (ties: the lowest id). On CPU, our op where the
    CPU ops are loaded: torch's argmax over rows does not vectorize (docs/PERF.md "The 32-row step")."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1 and ops_loaded():
        return argmax_rows(x)
    return x.argmax(dim=-1)


@dataclass(frozen=True)
class SamplingTensors:
    """One step's per-row parameters, [B] each, on the device (refilled every step)."""

    temperature: torch.Tensor  # f32; < eps: greedy
    top_k: torch.Tensor  # int64; 0: all
    top_p: torch.Tensor  # f32; 1.0: all
    min_p: torch.Tensor  # f32; 0.0: none
    presence: torch.Tensor  # f32
    frequency: torch.Tensor  # f32
    repetition: torch.Tensor  # f32
    seed: torch.Tensor  # int64: the request's seed, or a fresh draw per step for unseeded rows
    position: torch.Tensor  # int64: the row's output position (the noise's counter)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) in int64 arithmetic, element-wise."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * _MUL1) & _MASK32
    x = ((x ^ (x >> 15)) * _MUL2) & _MASK32
    x = ((x ^ (x >> 16)) * _MUL3) & _MASK32
    return x ^ (x >> 15)


def race_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [B, V] f32, a pure function of (seed [B], position [B], token id)."""
    row = _mix32(_mix32(seed) ^ (seed >> 32) ^ _mix32(position + 0x9E3779B9))  # [B] int64
    token = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    bits = _mix32(row[:, None] ^ _mix32(token * 2 + 1)[None, :])  # [B, V] int64 in [0, 2^32)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), never 0 or 1
    return -torch.log(u)


def sample_static(
    logits: torch.Tensor,
    params: SamplingTensors,
    penalty_state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """logits [B, V] f32 (not written); penalty_state: output_counts [B, V] int and prompt_mask
    [B, V] bool (each row's, zeros for rows without penalties; None: no penalties, as when the
    Sampler applied them already) -> token ids [B] int64, on the device.

    Greedy rows take the argmax of the penalized logits; the others divide by temperature, keep
    top-k/top-p and min-p, and take argmax(p / E) with E ~ Exp(1): a draw from p exactly, since
    the smallest of independent E_i / p_i falls on token i with probability p_i."""
    x = logits.float()  # [B, V] f32
    if penalty_state is not None:
        x = apply_penalties(x, *penalty_state, params.presence, params.frequency, params.repetition)
    greedy = (params.temperature < _SAMPLING_EPS) | (params.top_k == 1)  # as the Sampler's greedy rows
    greedy_tokens = greedy_ids(x)
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = x / temperature[:, None]
    scaled = apply_top_k_top_p(scaled, params.top_k, params.top_p)
    scaled = apply_min_p(scaled, params.min_p)
    probs = scaled.softmax(dim=-1)
    drawn = (probs / race_noise(params.seed, params.position, x.shape[1])).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, drawn)
