"""bench/offline.py on the demo model: token ids straight into `OfflineEngine`, throughput and
the step-time split, multi-turn prompts, the time bound, and the `offline` command."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from bench.__main__ import main
from bench.datasets import Conversation, DatasetSpec, Turn, build_dataset
from bench.offline import STAGES, EngineTokenCounter, format_offline, run_offline, timings_snapshot, turn_prompt
from engine.config import EngineConfig
from engine.front.offline import OfflineEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Iterator[OfflineEngine]:
    yield OfflineEngine.from_config(EngineConfig(max_num_seqs=4, kv_cache_memory="64MiB"))


def test_random_run_reports_throughput_and_the_step_split(engine: OfflineEngine) -> None:
    counter = EngineTokenCounter(engine)
    convs = build_dataset(DatasetSpec("random", 4, input_len=16, output_len=4), counter)
    report = run_offline(engine, convs, counter.encode, num_requests=4, duration_s=120)
    assert (report.num_requests, report.num_prompt_tokens, report.num_output_tokens) == (4, 64, 16)
    assert report.num_steps >= 4  # one token per request per step at most
    assert report.stage_seconds["forward"] > 0
    assert all(report.stage_seconds[s] >= 0 for s in STAGES)
    assert sum(report.stage_seconds.values()) <= report.duration_s
    assert report.output_throughput == pytest.approx(16 / report.duration_s)
    assert not (report.timed_out or report.interrupted) and not engine.has_unfinished()
    text = format_offline(report, "demo")
    assert all(stage in text for stage in STAGES) and "output token throughput" in text


def test_multi_turn_prompts_carry_the_previous_output(engine: OfflineEngine) -> None:
    counter = EngineTokenCounter(engine)
    convs = build_dataset(DatasetSpec("multi-turn", 4, input_len=8, output_len=3, num_turns=2), counter)
    report = run_offline(engine, convs, counter.encode, num_requests=4, duration_s=120)
    assert report.num_requests == 4
    # Two first turns of 8 tokens, two second turns of 8 + 3 generated + 8.
    assert report.num_prompt_tokens == 2 * 8 + 2 * (8 + 3 + 8)
    assert report.num_output_tokens == 4 * 3


def test_time_bound_stops_and_leaves_the_engine_empty(engine: OfflineEngine) -> None:
    counter = EngineTokenCounter(engine)
    convs = build_dataset(DatasetSpec("random", 4, input_len=8, output_len=200), counter)
    report = run_offline(engine, convs, counter.encode, num_requests=4, duration_s=0.5)
    assert report.timed_out and report.num_requests == 0
    assert not engine.has_unfinished()


def test_turn_prompt_extends_the_previous_prompt_and_output() -> None:
    conv = Conversation(0, (Turn("a b", 2, 1), Turn("c", 1, 1)), system="s", system_tokens=1)
    encode = lambda text: [ord(ch) for ch in text.replace(" ", "")]  # noqa: E731
    first = turn_prompt(conv, 0, encode)
    assert first == [ord("s"), ord("a"), ord("b")]
    assert turn_prompt(conv, 1, encode, first, [7, 8]) == [*first, 7, 8, ord("c")]


def test_timings_snapshot_reads_the_engine_counters(engine: OfflineEngine) -> None:
    snap = timings_snapshot(engine.timings)
    assert set(snap) == {*STAGES, "steps"}
    assert snap["steps"] == engine.timings.num_steps > 0


def test_offline_command_prints_the_split_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "offline.json"
    assert (
        main(
            [
                "offline",
                "--num-requests",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "3",
                "--max-num-seqs",
                "2",
                "--kv-cache-memory",
                "64MiB",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "forward" in printed and "detokenize" in printed
    summary = orjson.loads(out.read_bytes())["summary"]
    assert summary["completed"] == 2 and summary["total_output_tokens"] == 6
    assert summary["output_throughput"] > 0
    pct = [summary[f"step_time.{s}_pct"] for s in STAGES]
    assert sum(pct) == pytest.approx(100.0)
