"""`python -m bench profile`: where a decode step's time goes, by kind of work (matmuls, lm_head,
attention, norms, RoPE, activation, sampling, the rest of the Python around them), at given batch
sizes, measured in-process on the offline engine.

Wall time per kind comes from forward hooks on the model's layer classes (self time: a module's
time minus its timed children), so it counts the Python of each layer with its ops. The hooks cost
a few microseconds per module call; the unhooked step time is reported beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from engine.front.offline import OfflineEngine

# Module class name -> the kind its self time counts as. Classes not named here are not timed
# (their time stays in the nearest timed ancestor).
MODULE_KINDS = {
    "Linear": "matmuls",
    "NVFP4Linear": "matmuls",
    "Int8Linear": "matmuls",
    "Int4Linear": "matmuls",
    "PackedLinear": "matmuls",
    "RMSNorm": "norms",
    "RotaryEmbedding": "rope",
    "MLP": "activation",  # silu(gate) * up, after its two linears' time is taken out
    "Attention": "attention glue",  # q/k/v split and views around the backend call
    "DecoderLayer": "residuals",  # the two residual adds
    "DecoderForCausalLM": "embedding",
}
KINDS = (
    "matmuls",
    "lm_head",
    "attention",
    "attention plan",
    "norms",
    "rope",
    "activation",
    "residuals",
    "attention glue",
    "embedding",
    "compiled forward",
    "sampling",
    "engine (schedule, batch, update)",
)


class _SelfTimer:
    """Self wall time and self process CPU time per kind over nested enter/exit pairs.

    NOTE: CPU time counts every thread of the process (OpenMP workers included): on a shared
    machine it is the steadier measure of work, wall time the one users feel."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(KINDS, 0.0)
        self.cpu_seconds: dict[str, float] = dict.fromkeys(KINDS, 0.0)
        self._stack: list[list[Any]] = []  # [kind, wall start, cpu start, children's wall, children's cpu]

    def enter(self, kind: str) -> None:
        self._stack.append([kind, time.perf_counter(), time.process_time(), 0.0, 0.0])

    def exit(self) -> None:
        kind, start, cpu_start, children, cpu_children = self._stack.pop()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        self.seconds[kind] += elapsed - children
        self.cpu_seconds[kind] += cpu - cpu_children
        if self._stack:
            self._stack[-1][3] += elapsed
            self._stack[-1][4] += cpu

    def wrap(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(kind)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return timed


@contextmanager
def _hooked(engine: OfflineEngine, timer: _SelfTimer) -> Iterator[None]:
    runner = engine.core.runner
    handles = []
    head = runner.model.lm_head
    for module in runner.model.modules():
        # The lm_head's own linear counts as the lm_head (compute_logits around it is timed too).
        kind = "lm_head" if module is head else MODULE_KINDS.get(type(module).__name__)
        if kind is None:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, k=kind: timer.enter(k)))
        handles.append(module.register_forward_hook(lambda m, a, o: timer.exit()))
    patched: list[tuple[object, str]] = []

    def patch(obj: object, name: str, kind: str) -> None:
        setattr(obj, name, timer.wrap(getattr(obj, name), kind))
        patched.append((obj, name))

    patch(runner.backend, "forward", "attention")
    if hasattr(runner.backend, "attend_qkv"):  # the CPU backend's RoPE + cache write + attention op
        patch(runner.backend, "attend_qkv", "attention")
    patch(runner.backend, "plan", "attention plan")
    patch(runner.model, "compute_logits", "lm_head")
    patch(runner.sampler, "launch", "sampling")  # what the runner calls (its read-back is deferred)
    compiled = getattr(runner, "compiled", None)
    if compiled is not None:
        patch(compiled, "forward", "compiled forward")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for obj, name in patched:
            delattr(obj, name)  # the instance attribute goes; the class method shows again


@dataclass(frozen=True)
class StepProfile:
    batch_size: int
    num_steps: int
    step_ms: float  # unhooked wall time per step
    cpu_ms: float  # unhooked process CPU time per step (all threads)
    hooked_step_ms: float
    hooked_cpu_ms: float
    kind_ms: dict[str, float]  # hooked self wall time per step, per kind
    kind_cpu_ms: dict[str, float]  # hooked self CPU time per step, per kind

    def to_dict(self) -> dict[str, object]:
        return {
            "batch_size": self.batch_size,
            "num_steps": self.num_steps,
            "step_ms": self.step_ms,
            "cpu_ms": self.cpu_ms,
            "hooked_step_ms": self.hooked_step_ms,
            "hooked_cpu_ms": self.hooked_cpu_ms,
            "kind_ms": self.kind_ms,
            "kind_cpu_ms": self.kind_cpu_ms,
        }


def profile_decode(
    engine: OfflineEngine,
    batch_size: int,
    prompt_len: int,
    num_steps: int,
    temperature: float = 0.0,
    op_table: bool = False,
) -> tuple[StepProfile, str | None]:
    """Fill a decode batch of `batch_size` requests, then time `num_steps` steps plain and
    `num_steps` steps with hooks (and, with `op_table`, `num_steps` more under torch.profiler)."""
    from scheduler.request import SamplingParams

    vocab = engine.core.runner.model_config.vocab_size
    total = 3 * num_steps + 8 + (num_steps if op_table else 0)
    params = SamplingParams(max_tokens=total, min_tokens=total, ignore_eos=True, temperature=temperature)
    ids = []
    for i in range(batch_size):
        prompt = [(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(prompt_len)]
        ids.append(engine.add_request(prompt, params))
    started: set[str] = set()
    while len(started) < batch_size:  # prefill until every request has sampled its first token
        started.update(out.request_id for out in engine.step())
    for _ in range(4):  # every request decoding, first-call allocations done
        engine.step()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(num_steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / num_steps * 1e3
    cpu_ms = (time.process_time() - c0) / num_steps * 1e3
    timer = _SelfTimer()
    with _hooked(engine, timer):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(num_steps):
            timer.enter("engine (schedule, batch, update)")
            engine.step()
            timer.exit()
        hooked_ms = (time.perf_counter() - t0) / num_steps * 1e3
        hooked_cpu_ms = (time.process_time() - c0) / num_steps * 1e3
    table = None
    if op_table:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(num_steps):
                engine.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    for request_id in ids:
        engine.abort(request_id)
    kind_ms = {k: v / num_steps * 1e3 for k, v in timer.seconds.items() if v > 0}
    kind_cpu_ms = {k: v / num_steps * 1e3 for k, v in timer.cpu_seconds.items() if k in kind_ms}
    return StepProfile(batch_size, num_steps, step_ms, cpu_ms, hooked_ms, hooked_cpu_ms, kind_ms, kind_cpu_ms), table


def format_profile(profiles: Sequence[StepProfile], title: str) -> str:
    """ms per step by kind: wall, CPU (all threads), and the kind's share of the step's CPU."""
    width = 34 + 24 * len(profiles)
    lines = [
        f"{' ' + title + ' ':=^{width}}",
        f"{'':<34}" + "".join(f"{'batch ' + str(p.batch_size):>24}" for p in profiles),
        f"{'kind':<34}" + "".join(f"{'wall':>8}{'cpu':>8}{'cpu %':>8}" for _ in profiles),
    ]
    for kind in KINDS:
        if not any(kind in p.kind_ms for p in profiles):
            continue
        cells = []
        for p in profiles:
            ms, cpu = p.kind_ms.get(kind, 0.0), p.kind_cpu_ms.get(kind, 0.0)
            cells.append(f"{ms:>8.2f}{cpu:>8.2f}{100 * cpu / max(p.hooked_cpu_ms, 1e-9):>7.1f}%")
        lines.append(f"{kind:<34}" + "".join(cells))
    lines.append(
        f"{'step, with the hooks':<34}"
        + "".join(f"{p.hooked_step_ms:>8.2f}{p.hooked_cpu_ms:>8.2f}{'':>8}" for p in profiles)
    )
    lines.append(f"{'step, no hooks':<34}" + "".join(f"{p.step_ms:>8.2f}{p.cpu_ms:>8.2f}{'':>8}" for p in profiles))
    lines.append("=" * width)
    return "\n".join(lines)
