"""Batched sampling for one engine step, and the per-request state it needs between steps:
each request's output position, and, for penalty users only, its output token counts and
prompt mask. Semantics follow vLLM v1 (processor order, raw logprobs, min-p, penalties)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.core_types import SampledToken
from engine.device_sampling import (
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    greedy_ids,
    sample_static,
)
from engine.step_result import LogprobLayout, SampledBatch
from scheduler.request import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output.manager import GrammarMask

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / 1e-7 overflow float32.
_SAMPLING_EPS = 1e-5
_MIN_PENALTY_SLOTS = 8
_CDF_BLOCK = 256  # tokens per block of the two-level inverse-CDF draw
_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def noise_seed(seed: int, position: int) -> int:
    """Generator seed for a seeded request's noise at one output position. Hashed, not added,
    so (seed + 1, pos) and (seed, pos + 1) are unrelated streams: n > 1 uses seed + index."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position)


def draw_inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block_size: int = _CDF_BLOCK) -> torch.Tensor:
    """One token per row of probs [R, V] f32 (rows sum to ~1; zeros are never drawn) for the
    uniforms u [R, 1] in [0, 1): the token whose cumulative-probability bucket holds u * total.

    Two levels instead of a cumsum over the whole vocabulary: the cumsum of per-block sums picks
    the block, then a cumsum inside that block of `block_size` tokens picks the token. Exact up
    to float rounding of the bucket edges (~1e-7).

    NOTE: a full-vocabulary cumsum is a serial scan: at vocab 151,936 and 32 rows it took ~4 ms
    of CPU here, more than the softmax. An Exp(1) race (argmax of p / E) needs no cumsum but one
    random number per token, and torch's CPU exponential_ made it ~10x dearer than either."""
    num_rows, vocab_size = probs.shape
    num_full = vocab_size // block_size
    sums = probs[:, : num_full * block_size].view(num_rows, num_full, block_size).sum(-1)  # [R, NB]
    if num_full * block_size < vocab_size:
        sums = torch.cat([sums, probs[:, num_full * block_size :].sum(-1, keepdim=True)], dim=1)
    block_cdf = sums.cumsum(-1)  # [R, NB]
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    total = block_cdf[:, -1:]  # [R, 1]
    # NOTE: u * total can round up to total itself, which no bucket holds; just below it lands in
    # a block with mass > 0 (a masked token must never be drawn). Same inside the block.
    target = torch.minimum(u * total, torch.nextafter(total, zero))  # [R, 1]
    block = torch.searchsorted(block_cdf, target, right=True)  # [R, 1] int64
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), zero)  # [R, 1]
    token = block * block_size + torch.arange(block_size, device=probs.device)  # [R, bs]
    inner = probs.gather(1, token.clamp(max=vocab_size - 1)).masked_fill_(token >= vocab_size, 0).cumsum(-1)
    rest = torch.minimum((target - before).clamp(min=0), torch.nextafter(inner[:, -1:], zero))
    return (block * block_size + torch.searchsorted(inner, rest, right=True))[:, 0]


@dataclass(eq=False)
class _RequestState:
    """What the sampler remembers of one request between steps (mutable; sampler-owned)."""

    params: SamplingParams
    min_tokens_ids: tuple[int, ...]  # EOS (unless ignore_eos) and stop ids: -inf before min_tokens
    penalty_slot: int | None  # its row of the penalty pool; None when it uses no penalties
    num_output_tokens: int = 0  # tokens sampled so far: min_tokens and the seeded noise key on it

    @property
    def greedy(self) -> bool:
        return self.params.temperature < _SAMPLING_EPS or self.params.top_k == 1


class Sampler:
    """Samples one token per row of a step's logits and records it into the request's state.

    Requests are added when they first sample and removed when they finish or abort; a
    preempted request keeps its state (its outputs survive recompute).
    """

    def __init__(self, vocab_size: int, device: torch.device, static_draw: bool | None = None) -> None:
        """`static_draw`: random rows draw with engine/device_sampling.py (every row the same ops,
        noise hashed from (seed, position): no generator, no shapes that depend on the rows);
        None: on CUDA. Greedy rows are the same argmax either way."""
        assert vocab_size > 0, f"vocab_size must be positive, got {vocab_size}"
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._states: dict[str, _RequestState] = {}
        # Penalty pool: one row per slot, grown by doubling, only for requests with penalties.
        self._output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)  # [S, V]
        self._prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)  # [S, V]
        self._free_slots: list[int] = []
        # Reseeded for every seeded row, so a row's noise depends on (seed, position) only.
        self._generator = torch.Generator(device=self.device)
        self.static_draw = self.device.type == "cuda" if static_draw is None else static_draw
        self._step_seeds = random.Random(0)  # unseeded rows' noise seeds in the static draw

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        eos_token_ids: Sequence[int],
    ) -> None:
        assert request_id not in self._states, f"request {request_id!r} is already in the sampler"
        assert all(0 <= t < self.vocab_size for t in eos_token_ids), f"EOS {eos_token_ids} outside vocab"
        # User ids were checked by engine/front/input_processor.py: here they are invariants.
        assert all(0 <= t < self.vocab_size for t, _ in params.logit_bias), f"{request_id}: logit_bias outside vocab"
        assert all(0 <= t < self.vocab_size for t in params.stop_token_ids), f"{request_id}: stop ids outside vocab"
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        min_tokens_ids = tuple(dict.fromkeys(params.stop_token_ids + eos))
        slot = self._take_slot(prompt_token_ids) if params.uses_penalties else None
        self._states[request_id] = _RequestState(params, min_tokens_ids, slot)

    def remove_request(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.penalty_slot is not None:
            self._free_slots.append(state.penalty_slot)

    def sample(
        self, logits: torch.Tensor, request_ids: Sequence[str], grammar_mask: GrammarMask | None = None
    ) -> list[SampledToken]:
        """logits [num_rows, vocab_size] f32 or bf16, row i for request_ids[i]; one token each.

        `grammar_mask` (engine/structured_output/manager.py) goes first: its rows get -inf at every token their
        grammar forbids, and everything after (penalties, filters, the draw, logprobs) sees the
        masked rows, as in vLLM. A step without one pays nothing for it."""
        states = self._states_of(logits, request_ids)
        if not states:
            return []
        if grammar_mask is not None:
            logits = grammar_mask.apply(logits)  # [B, V] f32, a masked copy
        return self._launch(logits, states).read()

    def launch(
        self, logits: torch.Tensor, request_ids: Sequence[str], grammar_mask: GrammarMask | None = None
    ) -> SampledBatch:
        """`sample` without the read-back: the ids stay on the device until `SampledBatch.read`.
        Each request's state (output position, penalty counts) advances now, so the next step
        can sample before this one is read back."""
        states = self._states_of(logits, request_ids)
        if grammar_mask is not None:
            logits = grammar_mask.apply(logits)
        return self._launch(logits, states)

    def _launch(self, logits: torch.Tensor, states: list[_RequestState]) -> SampledBatch:
        processed = self._process(logits, states)
        token_ids = self._draw(processed, states)  # [B] int64, device
        self._record(token_ids, states)
        return self._pack(logits, token_ids, states)

    def process_logits(self, logits: torch.Tensor, request_ids: Sequence[str]) -> torch.Tensor:
        """The logits greedy rows take the argmax of and random rows divide by temperature:
        min_tokens, logit_bias, then penalties. [B, V] f32; the input is never written."""
        return self._process(logits, self._states_of(logits, request_ids))

    def _states_of(self, logits: torch.Tensor, request_ids: Sequence[str]) -> list[_RequestState]:
        assert logits.shape == (len(request_ids), self.vocab_size), (
            f"logits {tuple(logits.shape)} for {len(request_ids)} requests, vocab {self.vocab_size}"
        )
        assert len(set(request_ids)) == len(request_ids), "a request samples at most once per step"
        missing = [r for r in request_ids if r not in self._states]
        assert not missing, f"requests {missing} were never added to the sampler"
        return [self._states[r] for r in request_ids]

    def _process(self, logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_values: list[float] = []
        penalty_rows: list[int] = []
        for i, s in enumerate(states):
            # NOTE: not for a grammar's rows: once the grammar is complete its stop tokens are
            # all it allows, and masking them too would leave nothing to sample.
            if s.num_output_tokens < s.params.min_tokens and s.params.structured is None:
                mask_rows += [i] * len(s.min_tokens_ids)
                mask_cols += s.min_tokens_ids
            for token_id, bias in s.params.logit_bias:
                bias_rows.append(i)
                bias_cols.append(token_id)
                bias_values.append(bias)
            if s.penalty_slot is not None:
                penalty_rows.append(i)
        if not (mask_rows or bias_rows or penalty_rows):
            return logits.float()  # may alias the input: nothing downstream writes into it
        x = logits.to(torch.float32, copy=True)  # [B, V] f32, written in place below
        if mask_rows:
            x[self._tensor(mask_rows), self._tensor(mask_cols)] = -math.inf
        if bias_rows:
            x.index_put_(
                (self._tensor(bias_rows), self._tensor(bias_cols)),
                self._tensor(bias_values, torch.float32),
                accumulate=True,
            )
        if penalty_rows:
            pstates = [states[i] for i in penalty_rows]
            slots = self._tensor([s.penalty_slot for s in pstates])
            presence = self._tensor([s.params.presence_penalty for s in pstates], torch.float32)
            frequency = self._tensor([s.params.frequency_penalty for s in pstates], torch.float32)
            repetition = self._tensor([s.params.repetition_penalty for s in pstates], torch.float32)
            counts, prompt_mask = self._output_counts[slots], self._prompt_mask[slots]
            x = self._on_rows(
                x,
                penalty_rows,
                lambda rows: apply_penalties(rows, counts, prompt_mask, presence, frequency, repetition),
            )
        return x

    def _draw(self, x: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
        random_rows = [i for i, s in enumerate(states) if not s.greedy]
        if not random_rows:
            return greedy_ids(x)
        if self.static_draw:
            return self._draw_static(x, states)
        if len(random_rows) == len(states):
            return self._draw_random(x, states)
        token_ids = greedy_ids(x)
        rows = self._tensor(random_rows)
        token_ids[rows] = self._draw_random(x[rows], [states[i] for i in random_rows])
        return token_ids

    def _draw_static(self, x: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
        """Every row through engine/device_sampling.py (penalties are in x already). Each row's
        parameters go to the device as one small copy per dtype; no sync."""
        floats = self._tensor(
            [[s.params.temperature, s.params.top_p, s.params.min_p] for s in states], torch.float32
        )  # [B, 3]
        ints = self._tensor(
            [
                [
                    s.params.top_k,
                    s.params.seed if s.params.seed is not None else self._step_seeds.getrandbits(62),
                    s.num_output_tokens,
                ]
                for s in states
            ]
        )  # [B, 3] int64
        zeros = torch.zeros(len(states), dtype=torch.float32, device=self.device)
        params = SamplingTensors(
            temperature=floats[:, 0],
            top_k=ints[:, 0],
            top_p=floats[:, 1],
            min_p=floats[:, 2],
            presence=zeros,
            frequency=zeros,
            repetition=zeros + 1.0,
            seed=ints[:, 1],
            position=ints[:, 2],
        )
        return sample_static(x, params)

    def _draw_random(self, x: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
        """x [R, V] f32 (not written); temperature -> top-k/top-p -> min-p -> inverse-CDF draw."""
        temperature = self._tensor([s.params.temperature for s in states], torch.float32)
        x = x / temperature[:, None]  # [R, V] f32, a new tensor the filters may write into
        kp_rows = [i for i, s in enumerate(states) if 0 < s.params.top_k < self.vocab_size or s.params.top_p < 1.0]
        if kp_rows:
            top_ks = [states[i].params.top_k for i in kp_rows]
            top_k = self._tensor(top_ks)
            top_ps = [states[i].params.top_p for i in kp_rows]
            # Decided on the host: a device-side `.any()` would sync the step.
            top_p = self._tensor(top_ps, torch.float32) if min(top_ps) < 1.0 else None
            # Every row capped (0 means all): a partial selection instead of a sort of the vocabulary.
            max_top_k = max(top_ks) if min(top_ks) > 0 else None
            x = self._on_rows(x, kp_rows, lambda rows: apply_top_k_top_p(rows, top_k, top_p, max_top_k))
        min_p_rows = [i for i, s in enumerate(states) if s.params.min_p > 0.0]
        if min_p_rows:
            min_p = self._tensor([states[i].params.min_p for i in min_p_rows], torch.float32)
            x = self._on_rows(x, min_p_rows, lambda rows: apply_min_p(rows, min_p))
        probs = x.softmax(dim=-1)  # [R, V] f32
        u = torch.empty(len(states), 1, dtype=torch.float32, device=probs.device)  # [R, 1]
        if any(s.params.seed is None for s in states):
            u.uniform_()  # one draw for the unseeded rows; seeded rows are redrawn below
        for i, s in enumerate(states):
            if s.params.seed is not None:
                self._generator.manual_seed(noise_seed(s.params.seed, s.num_output_tokens))
                u[i].uniform_(generator=self._generator)
        return draw_inverse_cdf(probs, u)

    def _record(self, token_ids: torch.Tensor, states: list[_RequestState]) -> None:
        penalty_rows = [i for i, s in enumerate(states) if s.penalty_slot is not None]
        if penalty_rows:
            slots = self._tensor([states[i].penalty_slot for i in penalty_rows])
            ones = torch.ones(len(penalty_rows), dtype=torch.int32, device=self.device)
            # On device, no read-back; O(1) per row whatever the output length.
            sampled = token_ids[self._tensor(penalty_rows)]
            self._output_counts.index_put_((slots, sampled), ones, accumulate=True)
        for s in states:
            s.num_output_tokens += 1

    def _pack(self, logits: torch.Tensor, token_ids: torch.Tensor, states: list[_RequestState]) -> SampledBatch:
        """The ids and the logprobs asked for, as one device tensor to read back later."""
        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        num_top = min(self.vocab_size, max((states[i].params.logprobs or 0 for i in lp_rows), default=0))
        # Everything goes back in one float64 tensor (ids < 2^53 are exact): one sync per step.
        parts = [token_ids.double()]
        if lp_rows:
            rows = self._tensor(lp_rows)
            raw = torch.log_softmax(logits[rows].float(), dim=-1)  # [L, V] f32, raw logits
            parts.append(raw.gather(1, token_ids[rows][:, None]).squeeze(1).double())
            if num_top:
                top_logprobs, top_ids = raw.topk(num_top, dim=-1)  # [L, N], descending
                parts += [top_ids.double().flatten(), top_logprobs.double().flatten()]
        layout = LogprobLayout(tuple(lp_rows), num_top, tuple(states[i].params.logprobs or 0 for i in lp_rows))
        return SampledBatch(token_ids, torch.cat(parts) if len(parts) > 1 else parts[0], layout)

    def _take_slot(self, prompt_token_ids: Sequence[int]) -> int:
        if not self._free_slots:
            old = self._output_counts.shape[0]
            new = max(_MIN_PENALTY_SLOTS, 2 * old)
            counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
            prompt_mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
            counts[:old] = self._output_counts
            prompt_mask[:old] = self._prompt_mask
            self._output_counts, self._prompt_mask = counts, prompt_mask
            self._free_slots.extend(range(new - 1, old - 1, -1))  # pop() hands out low slots first
        slot = self._free_slots.pop()
        self._output_counts[slot].zero_()
        self._prompt_mask[slot].zero_()
        if prompt_token_ids:
            self._prompt_mask[slot, self._tensor(list(prompt_token_ids))] = True
        return slot

    def _on_rows(self, x: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """fn applied to the given rows of x (written in place unless it is every row)."""
        if len(rows) == x.shape[0]:
            return fn(x)
        index = self._tensor(rows)
        x[index] = fn(x[index])
        return x

    def _tensor(self, values: Sequence[int] | Sequence[float], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A small host list (per-row params, indices) as a device tensor: one copy, no sync."""
        return torch.tensor(values, dtype=dtype, device=self.device)
