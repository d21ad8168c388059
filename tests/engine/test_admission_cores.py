"""Data parallel, the one admission rule over several engine cores (engine/front/admission.py): queued
is what no core can start at its next step. A core's waiting samples beyond its free slots are
queued even while another core idles (they cannot move); requests not yet placed are queued only
beyond the free slots of all the cores together; with one core the rule is the one it always was."""

from __future__ import annotations

import itertools

import pytest

from engine.front.admission import Admission, EngineOverloadedError, QueueLimits
from scheduler.output import SchedulerStats

MAX_NUM_SEQS = 2


def report(running: int, waiting: int, added: int, queued_tokens: int = 0) -> SchedulerStats:
    return SchedulerStats(running, waiting, 0, 1, 0, 0, 0, num_added=added, num_queued_tokens=queued_tokens)


def two_cores(limits: QueueLimits = QueueLimits()) -> Admission:
    """Core 0 full with one waiting (10 prompt tokens); core 1 idle."""
    admission = Admission(limits, MAX_NUM_SEQS, num_cores=2)
    admission.on_stats(report(2, 1, 3, queued_tokens=10), core=0)
    admission.on_stats(report(0, 0, 0), core=1)
    return admission


def test_a_cores_backlog_is_queued_while_another_core_idles() -> None:
    admission = two_cores()
    assert admission.num_queued_requests() == 1
    assert admission.loads() == [3, 0]
    # Requests being tokenized go wherever there is room: core 1's two slots first.
    assert [admission.num_queued_requests(ahead) for ahead in (1, 2, 3, 4)] == [1, 1, 2, 3]
    admission.on_sent(2, 7, core=1)  # in transit to core 1: its slots are spoken for
    assert admission.loads() == [3, 2]
    assert admission.num_queued_requests(ahead=1) == 2
    admission.on_sent(1, 5, core=1)
    assert admission.num_queued_requests() == 2 and admission.num_queued_tokens() == 10 + 5
    admission.on_stats(report(2, 1, 3, queued_tokens=5), core=1)  # core 1 counted all three
    assert admission.num_queued_tokens() == 15 and admission.loads() == [3, 3]
    admission.on_core_lost(0)
    assert admission.loads() == [0, 3] and admission.num_queued_requests() == 1


def test_a_request_another_core_can_start_is_admitted_past_the_bound() -> None:
    admission = two_cores(QueueLimits(max_queued_requests=1, max_queued_tokens=10))
    admission.admit(2, 100)  # two samples, both fit in core 1's free slots: nothing more waits
    admission.on_sent(2, 100, core=1)
    with pytest.raises(EngineOverloadedError, match=r"1 requests are already waiting .* \(limit 1\)"):
        admission.admit(1, 1)
    one_core = Admission(QueueLimits(max_queued_requests=1), MAX_NUM_SEQS)
    one_core.on_stats(report(2, 1, 3))
    with pytest.raises(EngineOverloadedError):
        one_core.admit(1, 1)


@pytest.mark.parametrize(
    "running,waiting,in_transit,ahead", list(itertools.product(range(3), range(3), range(3), range(3)))
)
def test_one_core_keeps_the_rule_it_had(running: int, waiting: int, in_transit: int, ahead: int) -> None:
    admission = Admission(QueueLimits(), MAX_NUM_SEQS)
    admission.on_stats(report(running, waiting, running + waiting))
    admission.on_sent(in_transit, 4)
    free = max(0, MAX_NUM_SEQS - running)
    assert admission.num_queued_requests(ahead) == max(0, waiting + in_transit + ahead - free)
