"""Small CPU steps run on one thread or on torch's, whichever the engine measured faster here
(engine/host/small_step_threads.py): the comparison alternates, picks the faster with a margin for
torch's threads, compares again later, and the runner runs its forward with the verdict."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.front.offline import OfflineEngine
from engine.host.small_step_threads import ONE_THREAD_MARGIN, SmallStepThreads
from scheduler.request import SamplingParams
from tests.factories import make_checkpoint


def run_comparison(chooser: SmallStepThreads, one: float, many: float, rows: int = 1) -> list[bool | None]:
    """Feed the chooser steps timed `one` s on one thread and `many` s on several until it decides."""
    answers = []
    for _ in range(2 * chooser.probe_steps):
        choice = chooser.choose(rows)
        answers.append(choice)
        chooser.record(choice, one if choice else many)
    return answers


def test_the_faster_setting_wins_and_ties_keep_torchs_threads(caplog: pytest.LogCaptureFixture) -> None:
    chooser = SmallStepThreads(threads=2, probe_steps=4, reprobe_every=10)
    with caplog.at_level(logging.INFO, logger="fp4serve.small_step_threads"):
        answers = run_comparison(chooser, one=0.008, many=0.014)
    assert answers == [False, True] * 4  # alternating, torch's threads first
    assert chooser.one_thread and chooser.comparisons == 1
    assert "run on one thread: measured 8.00 ms on one thread against 14.00 ms on 2" in caplog.text
    assert [chooser.choose(1) for _ in range(9)] == [True] * 9  # the verdict holds between comparisons
    # The tenth small step starts the next comparison; now one thread is barely faster: not enough.
    chooser.choose(1)
    run_comparison(chooser, one=0.0100 * ONE_THREAD_MARGIN * 1.01, many=0.0100)
    assert not chooser.one_thread and chooser.comparisons == 2


def test_large_steps_and_one_thread_engines_are_not_touched() -> None:
    chooser = SmallStepThreads(threads=2, max_rows=8, probe_steps=2)
    assert chooser.choose(9) is None
    chooser.record(None, 1.0)  # not counted
    assert chooser.comparisons == 0
    single = SmallStepThreads(threads=1)
    assert single.choose(1) is None


@pytest.fixture
def two_threads() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_runner_runs_small_steps_with_the_verdict(tmp_path: Path, two_threads: object) -> None:
    path = make_checkpoint(tmp_path / "llama", "llama")
    engine = OfflineEngine.from_config(EngineConfig(model=str(path), kv_cache_memory="4MiB"))
    runner = engine.core.runner
    chooser = runner.small_step_threads
    assert chooser is not None and chooser.threads == 2
    chooser.probe_steps = 3
    seen: list[int] = []
    forward = runner.model.forward

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    runner.model.forward = spy  # type: ignore[method-assign]
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert chooser.comparisons >= 1, "the decode steps were timed on both settings"
    # The prefill (4 rows, small) and the first decode steps alternate 2, 1, 2, 1, ... threads.
    assert seen[:6] == [2, 1, 2, 1, 2, 1]
    after = seen[6:]
    assert after and set(after) == {1 if chooser.one_thread else 2}
    assert torch.get_num_threads() == 2  # restored after each step
