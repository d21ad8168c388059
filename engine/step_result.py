"""What one model-runner step hands back: `StepResult` (the sampled tokens, read back),
`PendingStep`, a launched step whose read-back is deferred so that the host can schedule and
prepare the next step while the device computes this one (async scheduling), and the sampler's
`SampledBatch`: the ids on the device, read back (into pinned memory on CUDA) only when asked."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from engine.core_types import SampledToken
from engine.prompt_logprobs import PromptLogprobsByRequest


@dataclass(frozen=True)
class StepTimings:
    prepare: float  # build the batch tensors
    forward: float  # attention planning, the forward and the logits
    sample: float  # launch the sampler, and (once the step is read back) wait for and parse its ids
    draft: float = 0.0  # MTP drafting after the forward (fill + K draft steps); 0 without MTP


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, SampledToken]  # request id -> its (first) token, for the requests that sampled
    timings: StepTimings
    prompt_logprobs: PromptLogprobsByRequest = field(default_factory=dict)  # the prefill rows that asked
    # Requests that verified draft tokens: every token they emit this step, in order (sampled
    # holds the first). Absent for the others.
    emitted: dict[str, tuple[SampledToken, ...]] = field(default_factory=dict)
    # Hybrid models: verifying requests whose recurrent state was put back to before this step
    # (a draft was rejected): the scheduler recomputes their tokens (engine/spec_decode/rollback.py).
    rolled_back: frozenset[str] = frozenset()


class PendingStep:
    """A launched step. `result()` reads its sampled ids back (the step's one host sync, waited
    for at most once) and returns what `ModelRunner.execute` would have."""

    def __init__(self, read: Callable[[], StepResult] | StepResult, timings: StepTimings | None = None) -> None:
        """`read`: the step's result, or what reads it back; `timings`: the launch's host phases
        (taken from the result when there is one)."""
        self._read = read
        self._result: StepResult | None = read if isinstance(read, StepResult) else None
        assert timings is not None or self._result is not None, "a deferred step needs its launch timings"
        self.launch_timings: StepTimings = timings if timings is not None else read.timings  # type: ignore[union-attr]

    @property
    def done(self) -> bool:
        """The result was read back already (steps that needed host tokens at once)."""
        return self._result is not None

    def result(self) -> StepResult:
        if self._result is None:
            assert callable(self._read), "a pending step without a reader"
            t0 = time.perf_counter()
            result = self._read()
            waited = time.perf_counter() - t0
            self._result = replace(result, timings=replace(result.timings, sample=result.timings.sample + waited))
        return self._result


@dataclass(frozen=True)
class LogprobLayout:
    """Where the logprob rows sit in the packed tensor: rows `lp_rows` of the batch asked for
    logprobs, the top `num_top` of each, and each row wants `wanted[j]` of them."""

    lp_rows: tuple[int, ...] = ()
    num_top: int = 0
    wanted: tuple[int, ...] = ()


class SampledBatch:
    def __init__(self, token_ids: torch.Tensor, packed: torch.Tensor, layout: LogprobLayout) -> None:
        # [B] int64, device: the ids themselves, scattered into the next step's input_ids.
        self.token_ids = token_ids
        self.num_rows = int(token_ids.shape[0])
        self.layout = layout
        self._event: torch.cuda.Event | None = None
        if packed.device.type == "cuda":
            # One copy into pinned memory, waited for only when read: the stream runs on meanwhile.
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            packed = host
        self._packed = packed  # [B + L + 2 * L * N] float64: ids < 2^53 are exact

    def read(self) -> list[SampledToken]:
        """The host sync: one SampledToken per row."""
        if self._event is not None:
            self._event.synchronize()
        host: Sequence[float] = self._packed.tolist()
        num_rows, lay = self.num_rows, self.layout
        ids = [int(t) for t in host[:num_rows]]
        outputs = [SampledToken(token_id) for token_id in ids]
        num_lp, num_top = len(lay.lp_rows), lay.num_top
        top_ids_at, top_lps_at = num_rows + num_lp, num_rows + num_lp + num_lp * num_top
        for j, i in enumerate(lay.lp_rows):
            n = min(lay.wanted[j], num_top)
            row_ids = host[top_ids_at + j * num_top : top_ids_at + j * num_top + n]
            row_lps = host[top_lps_at + j * num_top : top_lps_at + j * num_top + n]
            outputs[i] = SampledToken(ids[i], host[num_rows + j], tuple(int(t) for t in row_ids), tuple(row_lps))
        return outputs
