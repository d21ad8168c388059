"""Whether a small CPU step (a few decode rows) runs on one thread or on all of torch's, as measured
on this machine while it serves.

Why measured: a one-row step of a small model opens over a hundred OpenMP parallel regions (each
int4 linear of each layer, and the head), and what a region costs beyond its work depends on the
machine: where the workers' short spin catches the next region, two threads are faster; where it
does not (a busy host, a VM whose two vCPUs are one core's hyperthreads, costly wake-ups), every
region pays a wake-up and one thread is faster, by several times (docs/PERF.md, "What explains the
Intel gap"). No flag or CPU feature tells which, so the engine times both on its own steps:
alternating for a few steps at start, then again every so often, and keeps the faster."""

from __future__ import annotations

import logging
import statistics

logger = logging.getLogger("fp4serve.small_step_threads")

SMALL_STEP_ROWS = 8  # steps of at most this many rows (decode, verify) are "small"
PROBE_STEPS = 16  # timed steps per setting in one comparison
REPROBE_EVERY = 4096  # small steps between comparisons (the host's load changes)
# One thread must be this much faster to be chosen: the threads are what torch picked, and ties go to them.
ONE_THREAD_MARGIN = 0.95


class SmallStepThreads:
    def __init__(
        self,
        threads: int,
        max_rows: int = SMALL_STEP_ROWS,
        probe_steps: int = PROBE_STEPS,
        reprobe_every: int = REPROBE_EVERY,
    ) -> None:
        self.threads = threads
        self.max_rows = max_rows
        self.probe_steps = probe_steps
        self.reprobe_every = reprobe_every
        self.one_thread = False  # the verdict small steps follow between comparisons
        self.comparisons = 0  # comparisons finished
        self._times: dict[bool, list[float]] = {False: [], True: []}
        self._probing = threads > 1
        self._since = 0

    def choose(self, rows: int) -> bool | None:
        """For a step of `rows` rows: True to run it on one thread, False on torch's threads, None
        when the step is not small or there is nothing to choose (then it is not recorded)."""
        if self.threads <= 1 or rows > self.max_rows:
            return None
        if self._probing:  # alternate, torch's threads first
            return len(self._times[False]) > len(self._times[True])
        self._since += 1
        if self._since >= self.reprobe_every:
            self._probing = True
        return self.one_thread

    def record(self, one_thread: bool | None, seconds: float) -> None:
        """The forward time of a step `choose` answered `one_thread` for."""
        if one_thread is None or not self._probing:
            return
        self._times[one_thread].append(seconds)
        if min(len(t) for t in self._times.values()) < self.probe_steps:
            return
        one, many = (statistics.median(self._times[flag]) for flag in (True, False))
        verdict = one < ONE_THREAD_MARGIN * many
        if verdict != self.one_thread or self.comparisons == 0:
            logger.info(
                "small steps (up to %d rows) run on %s: measured %.2f ms on one thread against %.2f ms on %d "
                "(median of %d steps each; compared again every %d small steps)",
                self.max_rows,
                "one thread" if verdict else f"{self.threads} threads",
                one * 1e3,
                many * 1e3,
                self.threads,
                self.probe_steps,
                self.reprobe_every,
            )
        self.one_thread = verdict
        self.comparisons += 1
        self._times = {False: [], True: []}
        self._probing = False
        self._since = 0
