"""The offline entry point: drive the engine without HTTP (tests, `bench offline`, scripts).
Steps run synchronously in the caller's thread, and the time of each phase is accumulated."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.front.input_processor import InputProcessor
from engine.front.metrics import EngineMetrics
from engine.front.output_processor import OutputProcessor
from engine.front.outputs import RequestOutput
from engine.front.tokenizer import Tokenizer
from scheduler.request import SamplingParams


@dataclass
class PhaseTimings:
    """Cumulative seconds per step phase."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    detokenize: float = 0.0  # scheduler update, detokenization, stop strings, outputs
    num_steps: int = 0

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.detokenize

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("schedule", "prepare", "forward", "sample", "detokenize", "num_steps")}


@dataclass
class OfflineResult:
    request_id: str
    prompt_token_ids: list[int]
    # one entry per sample (n)
    token_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    outputs: list[list[RequestOutput]] = field(default_factory=list)


class OfflineEngine:
    """The input processor, the engine core and the output processor, in the caller's thread."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info = core.info
        self.tokenizer = Tokenizer(core.model_path, core.info.eos_token_ids)
        self.metrics = EngineMetrics(core.info.model_name)
        self.input_processor = InputProcessor(
            core.info.vocab_size, core.info.max_model_len, self.tokenizer.eos_token_ids, self.tokenizer
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self.timings = PhaseTimings()
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> OfflineEngine:
        return cls(EngineCore(config))

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Validates first (raises ParamError)."""
        request_id = request_id if request_id is not None else f"offline-{next(self._ids)}"
        children = self.input_processor.process(request_id, prompt_token_ids, params)
        self.output_processor.add_request(request_id, children)
        for child in children:
            self.core.add_request(child)
        return request_id

    def abort(self, request_id: str) -> list[RequestOutput]:
        outputs, child_ids = self.output_processor.abort(request_id)
        self.core.abort_requests(child_ids)
        return outputs

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.core.schedule()
        t1 = time.perf_counter()
        result = self.core.execute(out)
        t2 = time.perf_counter()
        outputs, finished_by_stop = self.output_processor.process(self.core.update(out, result))
        self.core.abort_requests(finished_by_stop)
        t3 = time.perf_counter()
        tm = self.timings
        tm.schedule += t1 - t0
        tm.prepare += result.timings.prepare
        tm.forward += result.timings.forward
        tm.sample += result.timings.sample
        tm.detokenize += t3 - t2
        tm.num_steps += 1
        return outputs

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[OfflineResult]:
        """Run all prompts together to completion; results in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        assert len(plist) == len(prompts), "one SamplingParams per prompt"
        results: dict[str, OfflineResult] = {}
        for prompt, p in zip(prompts, plist):
            rid = self.add_request(prompt, p)
            results[rid] = OfflineResult(
                rid, list(prompt), [[] for _ in range(p.n)], [""] * p.n, [None] * p.n, [[] for _ in range(p.n)]
            )
        while self.has_unfinished():
            for out in self.step():
                r = results.get(out.request_id)
                if r is None:
                    continue
                r.token_ids[out.index].extend(out.new_token_ids)
                r.texts[out.index] += out.text_delta
                r.outputs[out.index].append(out)
                if out.finish_reason is not None:
                    r.finish_reasons[out.index] = out.finish_reason
        return list(results.values())
