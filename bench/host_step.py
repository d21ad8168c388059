"""`python -m bench host-step`: the host's share of a decode step, measured with a model whose
forward costs nothing. The scheduler, batch building, sampling, the read-back, update and the
front's output processing (detokenization) are the real code, driven by the engine's own loop
(engine/core_proc.py `EngineCoreLoop`); only the model is replaced by fixed hidden states and
logits. A simulated device stream runs each launched forward for `forward_ms`, so the table also
shows how much of the engine loop's host time is NOT hidden behind the forward, with async
scheduling on and off. Output processing is timed on the same outputs but outside the loop's
window: in the server it runs in the front's process, beside the engine's.
engine/ is imported inside functions (bench/ layering rule)."""

from __future__ import annotations

import datetime
import gc
import platform
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_SPIN_S = 0.001
PHASES = ("schedule", "prepare", "plan", "sample", "read_back", "update", "output")


@dataclass
class HostStep:
    """One (batch size, forward time, mode) run: per-step means in milliseconds."""

    batch_size: int
    forward_ms: float
    async_scheduling: bool
    num_steps: int
    step_ms: float = 0.0  # the engine loop's wall time per step, steady state
    phases_ms: dict[str, float] = field(default_factory=dict)  # host work per step, by phase

    @property
    def host_ms(self) -> float:
        """The engine process's host work per step (output processing runs in the front's)."""
        return sum(v for k, v in self.phases_ms.items() if k != "output")

    @property
    def exposed_ms(self) -> float:
        """Host time not hidden behind the forward: what the step costs beyond the device's time."""
        return max(0.0, self.step_ms - self.forward_ms)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"host_ms": self.host_ms, "exposed_ms": self.exposed_ms}


class SimulatedStream:
    """A device queue: each forward starts when the previous one ended (or at its launch, if the
    queue was idle) and takes `forward_ms`; a read-back waits for its step's end."""

    def __init__(self, forward_ms: float) -> None:
        self.forward_s = forward_ms / 1000
        self.busy_until = 0.0

    def submit(self) -> float:
        """Queue one forward now; returns when it completes (perf_counter seconds)."""
        self.busy_until = max(self.busy_until, time.perf_counter()) + self.forward_s
        return self.busy_until

    @staticmethod
    def wait(until: float) -> None:
        """Block until `until`, as a CUDA event's wait blocks the host: sleep, then spin the last
        stretch (a sleep wakes late by more than the host times measured here)."""
        delay = until - time.perf_counter() - _SPIN_S
        if delay > 0:
            time.sleep(delay)
        while time.perf_counter() < until:
            pass


class _Pending:
    """A launched step whose read-back first waits for its simulated forward to end."""

    def __init__(self, inner: Any, done_at: float, probe: _TimedCore) -> None:
        self._inner, self._done_at, self._probe = inner, done_at, probe

    def result(self) -> Any:
        SimulatedStream.wait(self._done_at)
        t0 = time.perf_counter()
        result = self._inner.result()
        self._probe.add("read_back", time.perf_counter() - t0)
        return result


class _TimedCore:
    """The engine core seen by the loop, each host phase timed."""

    def __init__(self, core: Any, stream: SimulatedStream) -> None:
        self._core = core
        self.stream = stream
        self.async_scheduling = core.async_scheduling
        self.totals = dict.fromkeys(PHASES, 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def add(self, phase: str, seconds: float) -> None:
        self.totals[phase] += seconds

    def can_schedule_ahead(self) -> bool:
        return self.async_scheduling and self._core.scheduler.can_schedule_ahead()

    def schedule(self) -> Any:
        t0 = time.perf_counter()
        out = self._core.scheduler.schedule(async_step=self.async_scheduling)
        self.add("schedule", time.perf_counter() - t0)
        return out

    def launch(self, out: Any) -> _Pending:
        inner = self._core.launch(out)
        done_at = self.stream.submit()
        timings = inner.launch_timings
        self.add("prepare", timings.prepare)
        self.add("plan", timings.forward)
        self.add("sample", timings.sample)
        return _Pending(inner, done_at, self)

    def execute(self, out: Any) -> Any:
        return self.launch(out).result()

    def update(self, out: Any, result: Any) -> Any:
        t0 = time.perf_counter()
        outputs = self._core.update(out, result)
        self.add("update", time.perf_counter() - t0)
        return outputs


def stub_forward(runner: Any, seed: int = 0) -> None:
    """The runner's model costs nothing: fixed hidden states and fixed random logits (so greedy
    rows differ). NOTE: no attention plan either: the CPU backend's is not the one a GPU runs
    (FlashInfer's plan is captured in the graph's inputs)."""
    import torch

    cfg = runner.model_config
    max_tokens = runner.config.max_num_batched_tokens
    g = torch.Generator().manual_seed(seed)
    hidden = torch.zeros(max_tokens, cfg.hidden_size, dtype=runner.dtype, device=runner.device)  # [T, H]
    logits = torch.randn(max_tokens, cfg.vocab_size, generator=g).to(runner.device)  # [T, V] f32

    def forward(batch: Any) -> torch.Tensor:
        return hidden[: batch.num_tokens]

    runner.graphs.forward = forward
    runner.model.compute_logits = lambda rows: logits[: rows.shape[0]]


def measure(
    engine: Any, batch_size: int, forward_ms: float, async_scheduling: bool, num_steps: int, warmup: int, input_len: int
) -> HostStep:
    """`batch_size` greedy requests prefill, decode `warmup` steps, then `num_steps` timed steps."""
    from engine.core_proc import EngineCoreLoop
    from scheduler.request import SamplingParams

    core = engine.core
    core.async_scheduling = async_scheduling
    timed = _TimedCore(core, SimulatedStream(forward_ms))
    output_s = [0.0]

    def emit(outputs: Any) -> None:
        t0 = time.perf_counter()
        _, finished_by_stop = engine.output_processor.process(outputs)
        core.abort_requests(finished_by_stop)
        output_s[0] += time.perf_counter() - t0

    emitted: list[Any] = []
    loop = EngineCoreLoop(timed, emitted.append)
    params = SamplingParams(max_tokens=warmup + num_steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request([(7 * i + j) % 1000 + 1 for j in range(input_len)], params)
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        loop.step()
    for _ in range(warmup):
        loop.step()
    for outputs in emitted:
        emit(outputs)
    emitted.clear()
    timed.totals = dict.fromkeys(PHASES, 0.0)
    output_s[0] = 0.0
    t0 = time.perf_counter()
    for _ in range(num_steps):
        loop.step()
    wall = time.perf_counter() - t0
    # The front's work on the same outputs, timed apart: in the server it runs in its own process,
    # beside the engine loop, not in it.
    for outputs in emitted:
        emit(outputs)
    emitted.clear()
    phases = timed.totals | {"output": output_s[0]}
    while core.has_unfinished():
        loop.step()
    loop.drain()
    for outputs in emitted:
        emit(outputs)
    return HostStep(
        batch_size,
        forward_ms,
        async_scheduling,
        num_steps,
        1000 * wall / num_steps,
        {k: 1000 * v / num_steps for k, v in phases.items()},
    )


def run_host_step(
    batch_sizes: Sequence[int],
    forward_ms: Sequence[float],
    num_steps: int,
    warmup: int,
    input_len: int,
    hidden_size: int,
    model: str | None = None,
) -> list[HostStep]:
    import torch

    from bench.context_curve import write_tiny_model
    from engine.config import EngineConfig
    from engine.front.offline import OfflineEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = model or str(write_tiny_model(Path(tmp) / "tiny", "dense", hidden_size, 1))
        max_seqs = max(batch_sizes)
        engine = OfflineEngine.from_config(
            EngineConfig(
                model=path,
                dtype="float32",
                max_num_seqs=max_seqs,
                max_num_batched_tokens=max(2048, max_seqs),
                max_model_len=input_len + warmup + num_steps + 64,
                kv_cache_memory="256MiB",
                quantization="none",
            )
        )
    stub_forward(engine.core.runner)
    gc.collect()
    gc.freeze()  # as the engine process does once loaded (engine/core_proc.py); undone after
    # One intra-op thread: on a GPU server the host's small tensor ops (indexing, the CPU-side
    # copies) run on the engine thread alone, and a thread pool's wake-ups would be measured here
    # as host time that a GPU step does not pay.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [
            measure(engine, batch_size, ms, on, num_steps, warmup, input_len)
            for batch_size in batch_sizes
            for ms in forward_ms
            for on in (False, True)
        ]
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()


def format_host_step(results: Sequence[HostStep]) -> str:
    head = f"{'batch':>5} {'fwd ms':>6} {'async':>5} {'step ms':>8} {'host ms':>8} {'exposed':>8}  " + " ".join(
        f"{p:>9}" for p in PHASES
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.batch_size:>5} {r.forward_ms:>6.2f} {'on' if r.async_scheduling else 'off':>5} "
            f"{r.step_ms:>8.3f} {r.host_ms:>8.3f} {r.exposed_ms:>8.3f}  "
            + " ".join(f"{r.phases_ms[p]:>9.3f}" for p in PHASES)
        )
    return "\n".join(lines)


def host_step_document(results: Sequence[HostStep], config: dict[str, Any]) -> dict[str, Any]:
    return {
        "config": config,
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "results": [r.to_dict() for r in results],
    }
