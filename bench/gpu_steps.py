"""Decode step time as the engine runs it, against the HBM floor (bench/step_floor.py): for
bench/gpu.py, one `ModelRunner.execute` of a pure-decode batch per timed step, eager and (where the
engine captures them for the model, hybrids included) with its decode CUDA graphs. At batch sizes up
to VERIFY_MAX_BATCH it also times a speculative verify step, every request checking VERIFY_DRAFTS
draft tokens (verification and, for hybrids, the state snapshot and rollback included), eager and
from its graph, against the plain step. Random weights accept nothing, so the verify step itself is
what is timed. engine/ is imported inside functions (bench/ layering rule)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from bench.step_floor import StepFloor

BLOCK_SIZE = 16  # the engine's default KV page
WARMUP_STEPS = 3  # untimed decode steps per point: allocator, kernel selection, Triton compiles
VERIFY_DRAFTS = 3  # draft tokens per request in a timed verify step (the MTP figure: verify against plain)
VERIFY_MAX_BATCH = 16  # verify steps are timed at batch sizes up to this


@dataclass(frozen=True)
class StepRow:
    format: str
    batch_size: int
    context: int
    eager_ms: float
    graph_ms: float | None  # None: no decode CUDA graph for this model or device
    floor_ms: float
    bytes_per_step: int
    weight_bytes: int  # the parts of bytes_per_step (bench/step_floor.py StepBytes)
    expert_bytes: int
    kv_bytes: int
    state_bytes: int
    fraction_of_floor: float  # floor / the step as the engine runs it (graph if captured): 1.0 is the roofline
    # A verify step of VERIFY_DRAFTS drafts per request (None above VERIFY_MAX_BATCH): eager, from its
    # graph (None: not captured), and as the engine runs it over the plain step as the engine runs it.
    verify_eager_ms: float | None = None
    verify_graph_ms: float | None = None
    verify_over_plain: float | None = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step(batch_size: int, context: int, vocab: int, new: bool, hybrid: bool, drafts: int = 0) -> Any:
    """A SchedulerOutput of B requests each decoding the token after `context` tokens (and, with
    `drafts`, verifying that many draft tokens after it), on disjoint pages (and, `hybrid`, state
    slots); `new`: with the data that registers them with the runner's sampler."""
    from scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput
    from scheduler.request import SamplingParams

    pages = math.ceil((context + 1 + drafts) / BLOCK_SIZE)
    g = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(0, vocab, (batch_size, 1 + drafts), generator=g).tolist()
    data = NewRequestData(SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True), (0,), ())
    return SchedulerOutput(
        tuple(
            ScheduledRequest(
                f"decode-{batch_size}-{i}",
                tuple(tokens[i]),
                context,
                tuple(range(i * pages, (i + 1) * pages)),
                True,
                new_request=data if new else None,
                state_slot=i if hybrid else None,
                num_draft_tokens=drafts,
            )
            for i in range(batch_size)
        ),
        (),
    )


def time_decode(runner: Any, batch_size: int, context: int, reps: int, drafts: int = 0) -> float:
    """Median ms of `runner.execute` for one pure-decode step of `batch_size` (with `drafts`, a
    verify step of that many drafts per request), the same step repeated: each rewrites the same KV
    slots and advances the same states (a hybrid's rejected drafts roll them back)."""
    vocab, hybrid = runner.model_config.vocab_size, runner.model_config.hybrid is not None
    runner.execute(decode_step(batch_size, context, vocab, True, hybrid))
    step = decode_step(batch_size, context, vocab, False, hybrid, drafts)
    times = []
    for i in range(reps + WARMUP_STEPS):
        sync(runner.device)
        start = time.perf_counter()
        runner.execute(step)  # ends in the read-back of the sampled tokens
        if i >= WARMUP_STEPS:
            times.append((time.perf_counter() - start) * 1e3)
    runner.execute(replace(step, requests=(), finished_request_ids=tuple(r.request_id for r in step.requests)))
    return statistics.median(times)


def bench_decode_steps(
    runner: Any, fmt: str, batch_sizes: list[int], context: int, gbps: float, reps: int, progress: Callable[[str], None]
) -> tuple[list[StepRow], str]:
    """Eager first, then (where the engine would) the engine's decode graphs captured and replayed.
    Returns the rows and a line saying whether graphs ran and why not."""
    from engine.cuda_graph import graphs_disabled_reason

    pages_needed = max(batch_sizes) * math.ceil((context + 1 + VERIFY_DRAFTS) / BLOCK_SIZE)
    assert runner.num_kv_pages >= pages_needed, f"{runner.num_kv_pages} KV pages, {pages_needed} needed"
    verify_sizes = [b for b in batch_sizes if b <= VERIFY_MAX_BATCH]
    eager: dict[int, float] = {}
    verify_eager: dict[int, float] = {}
    for b in batch_sizes:
        eager[b] = time_decode(runner, b, context, reps)
        progress(f"{fmt}: eager decode step at batch {b}: {eager[b]:.2f} ms")
    for b in verify_sizes:
        verify_eager[b] = time_decode(runner, b, context, reps, VERIFY_DRAFTS)
        progress(f"{fmt}: eager verify step ({VERIFY_DRAFTS} drafts each) at batch {b}: {verify_eager[b]:.2f} ms")
    graph: dict[int, float] = {}
    verify_graph: dict[int, float] = {}
    graphs = runner.graphs
    why_not = graphs_disabled_reason(False, runner.device, runner.backend)
    if why_not is None:
        graphs.enable_verify_graphs(1 + VERIFY_DRAFTS)
        progress(
            f"{fmt}: capturing CUDA graphs (batch sizes {','.join(map(str, graphs.buckets.sizes))}; verify "
            f"steps: {'yes' if graphs.verify_query_len else 'no, the backend cannot'})"
        )
        try:
            graphs.capture()
            progress(f"{fmt}: captured")
        except RuntimeError as e:  # CUDA and capture errors: reported; the graphs captured before it still replay
            why_not = f"capture failed: {type(e).__name__}: {e}"
            progress(f"{fmt}: {why_not}")
        for b in batch_sizes:
            if graphs.buckets.bucket_for(b) in graphs.captured_sizes:
                graph[b] = time_decode(runner, b, context, reps)
                progress(f"{fmt}: graph decode step at batch {b}: {graph[b]:.2f} ms")
        for b in verify_sizes:
            if graphs.buckets.bucket_for(b) in graphs.captured_verify_sizes:
                verify_graph[b] = time_decode(runner, b, context, reps, VERIFY_DRAFTS)
                progress(f"{fmt}: graph verify step at batch {b}: {verify_graph[b]:.2f} ms")
    graphs_note = "on" if why_not is None else f"off ({why_not})"
    floor = StepFloor.from_runner(runner)
    rows = []
    for b in batch_sizes:
        parts = floor.step_bytes(b, context)
        floor_ms = parts.total / (gbps * 1e9) * 1e3
        g, vg, ve = graph.get(b), verify_graph.get(b), verify_eager.get(b)
        plain = eager[b] if g is None else g
        verify = vg if vg is not None else ve
        rows.append(
            StepRow(
                fmt,
                b,
                context,
                round(eager[b], 3),
                None if g is None else round(g, 3),
                round(floor_ms, 3),
                parts.total,
                parts.weights,
                parts.experts,
                parts.kv,
                parts.state,
                round(floor_ms / plain, 3),
                None if ve is None else round(ve, 3),
                None if vg is None else round(vg, 3),
                None if verify is None else round(verify / plain, 3),
            )
        )
    return rows, graphs_note
