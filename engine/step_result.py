"""What one model-runner step hands back: `StepResult` (the sampled tokens, read back) and
`PendingStep`, a launched step whose read-back is deferred so that the host can schedule and
prepare the next step while the device computes this one (async scheduling)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

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
