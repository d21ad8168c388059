"""`Heartbeat`: the engine loop's progress in a few shared-memory slots, written by the engine
process each step and read by the watchdog in the server process (engine/client/supervisor.py).

Why shared memory and not a message per step: a step that never ends sends nothing, yet the
watchdog must name its batch shape in the log; and a few stores per step cost about what taking a
timestamp does, where a pipe message would cost a pickle and a system call.

NOTE: times are `time.monotonic()`, which on Linux reads CLOCK_MONOTONIC: one clock for every
process on the machine, so the two processes' readings compare.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.output import ScheduledRequest

# Slot indices of the shared array of doubles.
_IN_STEP, _STEP_STARTED, _ALIVE, _NUM_STEPS, _NUM_REQUESTS, _NUM_TOKENS, _NUM_PREFILLS, _NUM_PREFILL_TOKENS = range(8)
_NUM_SLOTS = 8


@dataclass(frozen=True)
class BatchShape:
    num_requests: int
    num_tokens: int
    num_prefills: int  # requests computing prompt tokens (a chunk of more than one token, drafts aside)
    num_prefill_tokens: int

    @property
    def num_decodes(self) -> int:
        return self.num_requests - self.num_prefills

    def __str__(self) -> str:
        return (
            f"{self.num_requests} requests, {self.num_tokens} tokens: {self.num_prefills} prefills "
            f"({self.num_prefill_tokens} tokens), {self.num_decodes} decodes"
        )


@dataclass(frozen=True)
class HeartbeatReading:
    in_step: bool
    step_started: float  # time.monotonic() when the current (or last) step began
    alive: float  # when the loop last showed progress: a step ended, or it took new messages
    num_steps: int  # steps completed since the engine started
    shape: BatchShape  # of the current (or last) step


class Heartbeat:
    """One engine's slots. Created in the server process; handed to the engine process as the
    Process argument `slots` (a RawArray travels to a spawned child), rebuilt there with
    `Heartbeat(slots)`."""

    def __init__(self, slots: Any = None) -> None:
        # [8] float64, shared memory; no lock: each slot is one aligned 8-byte store, and a torn
        # read across slots can only mix two steps' shapes in a log line.
        self.slots = slots if slots is not None else multiprocessing.get_context("spawn").RawArray("d", _NUM_SLOTS)
        if slots is None:
            self.slots[_ALIVE] = time.monotonic()

    # ---- the engine's side -------------------------------------------------------------------------
    def beat(self) -> None:
        """The loop is alive and between steps (it took messages, or waits for a grammar)."""
        self.slots[_ALIVE] = time.monotonic()

    def step_begins(self, requests: Sequence[ScheduledRequest]) -> None:
        num_tokens = num_prefills = num_prefill_tokens = 0
        for r in requests:
            n = len(r.token_ids)
            num_tokens += n
            if n - r.num_draft_tokens > 1:
                num_prefills += 1
                num_prefill_tokens += n
        s = self.slots
        s[_NUM_REQUESTS], s[_NUM_TOKENS] = len(requests), num_tokens
        s[_NUM_PREFILLS], s[_NUM_PREFILL_TOKENS] = num_prefills, num_prefill_tokens
        s[_STEP_STARTED] = time.monotonic()
        s[_IN_STEP] = 1.0  # last: a reader that sees it sees this step's start and shape

    def step_ends(self) -> None:
        s = self.slots
        s[_ALIVE] = time.monotonic()
        s[_NUM_STEPS] += 1
        s[_IN_STEP] = 0.0

    # ---- the watchdog's side ------------------------------------------------------------------------
    def read(self) -> HeartbeatReading:
        s = self.slots[:]
        return HeartbeatReading(
            in_step=s[_IN_STEP] != 0.0,
            step_started=s[_STEP_STARTED],
            alive=s[_ALIVE],
            num_steps=int(s[_NUM_STEPS]),
            shape=BatchShape(
                int(s[_NUM_REQUESTS]), int(s[_NUM_TOKENS]), int(s[_NUM_PREFILLS]), int(s[_NUM_PREFILL_TOKENS])
            ),
        )
