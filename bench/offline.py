"""The offline engine benchmark: the serve workloads as token ids straight into `OfflineEngine`
(no HTTP, no chat template), reporting throughput and the step-time split, so that engine cost
and HTTP cost can be told apart."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from bench.datasets import COMMON_WORDS, Conversation
from engine.front.offline import OfflineEngine
from scheduler.request import SamplingParams

STAGES = ("schedule", "prepare", "forward", "sample", "detokenize")


class EngineTokenCounter:
    """The engine's own tokenizer as a dataset `TokenCounter`: exact counts, common words."""

    exact = True

    def __init__(self, engine: OfflineEngine) -> None:
        self._tok = engine.tokenizer
        self.name = "engine"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def words(self) -> Sequence[str]:
        return COMMON_WORDS


@dataclass(frozen=True)
class OfflineReport:
    """What an offline run measured. `stage_seconds` sums the engine's own step timings over the
    measured window (warm-up excluded)."""

    num_requests: int  # finished in the window
    num_prompt_tokens: int  # of the finished requests
    num_output_tokens: int  # generated in the window, finished or not
    duration_s: float
    num_steps: int
    stage_seconds: dict[str, float]
    timed_out: bool
    interrupted: bool

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / max(self.duration_s, 1e-9)

    @property
    def request_throughput(self) -> float:
        return self.num_requests / max(self.duration_s, 1e-9)

    def to_dict(self) -> dict[str, object]:
        total = sum(self.stage_seconds.values())
        split = {f"step_time.{k}_s": v for k, v in self.stage_seconds.items()}
        split.update(
            {f"step_time.{k}_pct": 100.0 * v / total if total else None for k, v in self.stage_seconds.items()}
        )
        return {
            "completed": self.num_requests,
            "total_prompt_tokens": self.num_prompt_tokens,
            "total_output_tokens": self.num_output_tokens,
            "duration_s": self.duration_s,
            "output_throughput": self.output_throughput,
            "request_throughput": self.request_throughput,
            "num_steps": self.num_steps,
            "step_time.other_s": self.duration_s - total,
            **split,
            "timed_out": self.timed_out,
            "interrupted": self.interrupted,
        }


def timings_snapshot(timings: object) -> dict[str, float]:
    """The engine's cumulative step timings as {stage: seconds, "steps": count}."""
    get: Callable[[str], object]
    if isinstance(timings, Mapping):
        get = lambda k: timings.get(k, 0.0)  # noqa: E731
    else:
        get = lambda k: getattr(timings, k, 0.0)  # noqa: E731
    out = {k: float(get(k) or 0.0) for k in STAGES}
    steps = get("steps") or get("num_steps") or 0.0
    out["steps"] = float(steps)  # type: ignore[arg-type]
    return out


def turn_prompt(
    conv: Conversation,
    turn: int,
    encode: Callable[[str], list[int]],
    previous: list[int] | None = None,
    previous_output: Sequence[int] = (),
) -> list[int]:
    """Token ids of a turn: the system prefix and the first user message, or the previous
    turn's prompt and output followed by this turn's user message."""
    if turn == 0:
        system = encode(conv.system) if conv.system else []
        return system + encode(conv.turns[0].text)
    assert previous is not None, "a later turn extends the previous prompt"
    return previous + list(previous_output) + encode(conv.turns[turn].text)


def run_offline(
    engine: OfflineEngine,
    conversations: Sequence[Conversation],
    encode: Callable[[str], list[int]],
    *,
    num_requests: int,
    duration_s: float,
    temperature: float = 1.0,
    on_finish: Callable[[], None] | None = None,
) -> OfflineReport:
    """Queue every conversation's first turn, step the engine until all `num_requests` turns
    finished (later turns join as their previous one ends) or `duration_s` passed."""
    active: dict[str, tuple[Conversation, int, list[int], list[int]]] = {}
    issued = 0

    def add(conv: Conversation, turn: int, prompt: list[int]) -> None:
        nonlocal issued
        n = conv.turns[turn].max_tokens
        # ignore_eos + min_tokens: every request generates exactly the asked length.
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=temperature, seed=issued)
        active[engine.add_request(prompt, params)] = (conv, turn, prompt, [])
        issued += 1

    for conv in conversations:
        if issued < num_requests:
            add(conv, 0, turn_prompt(conv, 0, encode))
    before = timings_snapshot(engine.timings)
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    finished = prompt_tokens = output_tokens = 0
    interrupted = False
    try:
        while engine.has_unfinished() and time.perf_counter() < deadline:
            for out in engine.step():
                state = active.get(out.request_id)
                if state is None:
                    continue
                conv, turn, prompt, outputs = state
                outputs.extend(out.new_token_ids)
                output_tokens += len(out.new_token_ids)
                if out.finish_reason is None:
                    continue
                del active[out.request_id]
                finished += 1
                prompt_tokens += len(prompt)
                if on_finish is not None:
                    on_finish()
                if turn + 1 < len(conv.turns) and issued < num_requests:
                    add(conv, turn + 1, turn_prompt(conv, turn + 1, encode, prompt, outputs))
    except KeyboardInterrupt:
        interrupted = True
    duration = time.perf_counter() - t0
    after = timings_snapshot(engine.timings)
    timed_out = not interrupted and bool(active)
    for request_id in list(active):  # leave the engine empty for whoever steps it next
        engine.abort(request_id)
    return OfflineReport(
        num_requests=finished,
        num_prompt_tokens=prompt_tokens,
        num_output_tokens=output_tokens,
        duration_s=duration,
        num_steps=int(after["steps"] - before["steps"]),
        stage_seconds={k: after[k] - before[k] for k in STAGES},
        timed_out=timed_out,
        interrupted=interrupted,
    )


def format_offline(report: OfflineReport, title: str) -> str:
    lines = [f"{' ' + title + ' ':=^64}"]
    for name, value in (
        ("requests finished", f"{report.num_requests}"),
        ("duration (s)", f"{report.duration_s:.2f}"),
        ("steps", f"{report.num_steps}"),
        ("output token throughput (tok/s)", f"{report.output_throughput:.1f}"),
        ("request throughput (req/s)", f"{report.request_throughput:.2f}"),
        ("prompt / output tokens", f"{report.num_prompt_tokens} / {report.num_output_tokens}"),
    ):
        lines.append(f"{name:<34}{value}")
    total = sum(report.stage_seconds.values())
    lines.append(f"{'step time':<22}{'seconds':>12}{'%':>10}{'ms/step':>12}")
    for stage in STAGES:
        s = report.stage_seconds[stage]
        lines.append(
            f"{stage:<22}{s:>12.3f}{100 * s / total if total else 0:>10.1f}{1000 * s / max(report.num_steps, 1):>12.2f}"
        )
    lines.append(f"{'outside the stages':<22}{report.duration_s - total:>12.3f}")
    if report.timed_out:
        lines.append("note: stopped by --duration with requests unfinished")
    if report.interrupted:
        lines.append("note: interrupted; figures cover what ran")
    lines.append("=" * 64)
    return "\n".join(lines)
