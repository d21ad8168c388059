"""Data parallel, fair share over the engine cores (engine/client/global_fair_share.py + the schedulers'
`external` counters, scheduler/fair_queue.py), driven through real Schedulers with fake sampled
tokens (pure Python, no model): a heavy key flooding two cores and a light key whose requests all
sit on one of them (its prefix is cached there) split the tokens as they do on one core with the
same batch slots; with each core fair only on its own counts, the light key gets a third."""

from __future__ import annotations

from collections.abc import Callable

from engine.client.global_fair_share import GlobalFairShare
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig

PROMPT, OUTPUT = 8, 8


def scheduler(max_num_seqs: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=256,
            max_model_len=128,
            block_size=4,
            num_blocks=4096,
            enable_prefix_caching=False,
            scheduling_policy="fair",
        )
    )


def request(rid: str, key: str, arrival: float) -> Request:
    return Request(rid, [1] * PROMPT, SamplingParams(max_tokens=OUTPUT, ignore_eos=True), arrival_time=arrival, key=key)


def step(s: Scheduler) -> None:
    out = s.schedule()
    s.update(out, {r.request_id: 7 for r in out.requests if r.sample})


def light_share(cores: list[Scheduler], placed: Callable[[str, int], int], sync: GlobalFairShare | None) -> float:
    """The light key's share of the tokens served while both keys had requests waiting. 40 heavy
    requests arrive first, then 20 light ones; placed(key, i) says on which core request i goes."""
    for i in range(40):
        cores[placed("heavy", i)].add_request(request(f"heavy{i}", "heavy", arrival=i))
    for i in range(20):
        cores[placed("light", i)].add_request(request(f"light{i}", "light", arrival=100 + i))
    if sync is not None:  # what AsyncEngine sends each core before its requests
        for c, core in enumerate(cores):
            core.seed_fair_share(sync.update_for(c))
    start = {key: sum(core.fair.served[key] for core in cores) for key in ("heavy", "light")}
    for _ in range(10_000):
        waiting = {r.key for core in cores for r in core.waiting}
        if waiting != {"heavy", "light"}:
            break
        for c, core in enumerate(cores):  # the cores step in turn, each report read by the front
            step(core)
            if sync is not None:
                queueing = [bool(other.waiting) for other in cores]
                for to, update in sync.on_report(c, core.stats().fair_charged, queueing):
                    cores[to].seed_fair_share(update)
    served = {key: sum(core.fair.served[key] for core in cores) - start[key] for key in start}
    assert sum(served.values()) > 200, served
    return served["light"] / sum(served.values())


def test_a_light_key_on_one_core_gets_the_split_it_gets_on_one_core() -> None:
    one = light_share([scheduler(max_num_seqs=2)], lambda key, i: 0, None)
    # Two cores of one slot each: the flood on both, the light key's requests all on core 0.
    two = light_share([scheduler(1), scheduler(1)], lambda key, i: 0 if key == "light" else i % 2, GlobalFairShare(2))
    alone = light_share([scheduler(1), scheduler(1)], lambda key, i: 0 if key == "light" else i % 2, None)
    assert 0.45 <= one <= 0.55, one
    assert abs(two - one) <= 0.05, (one, two)
    assert alone < 0.4, alone  # each core fair on its own: the light key gets half of core 0


def test_each_core_is_told_the_other_cores_charges_once() -> None:
    share = GlobalFairShare(3)
    assert share.on_report(0, (("a", 10.0), ("b", 2.0)), [False, True, False]) == [(1, (("a", 10.0), ("b", 2.0)))]
    assert share.on_report(0, (("a", 10.0), ("b", 2.0)), [True, True, True]) == []  # unchanged
    updates = share.on_report(1, (("a", 1.0),), [True, False, True])
    assert updates == [(0, (("a", 1.0),)), (2, (("a", 11.0), ("b", 2.0)))]
    assert share.update_for(1) == ()  # told already
    assert share.update_for(2) == ()
    assert dict(share.update_for(0, ["a", "c"])) == {} and share.external(0, "c") == 0.0
