"""What one scheduling step decided: per request, which new tokens run, from which position,
over which KV pages, and whether its last token is sampled; for hybrid models also which state
checkpoints are restored, written and copied (scheduler/checkpoint_manager.py), and what the host
tier spills and loads (scheduler/host_tier.py). Consumed by
engine/batch.py and the model runner. `SchedulerStats`: what the scheduler reports after a step."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.fair_queue import FairShareState
from scheduler.request import SamplingParams

# Async scheduling: a token sampled by the step still in flight. The runner replaces it with that
# step's sampled id on the device (engine/model_runner.py), so the host never waits for it.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class NewRequestData:
    """Sent once, the first step a request is scheduled: what the runner's sampler keeps."""

    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointSave:
    """Write the request's DeltaNet state after its first `num_tokens` tokens (inside or at the end
    of this step's tokens) into checkpoint `checkpoint_id`."""

    checkpoint_id: int
    num_tokens: int


@dataclass(frozen=True)
class StateSave:
    """Copy a slot's state into a checkpoint before anything else in the step (a sequence that
    finished or was preempted: its slot and pages may be reused this step); `kv_page`: the partial
    page whose KV goes with it, None when the state ends on a page boundary."""

    checkpoint_id: int
    state_slot: int
    kv_page: int | None


@dataclass(frozen=True)
class PageCopy:
    """Copy one full KV page (every attention layer, the MTP head's too) between a device page and a
    host slot of the host tier (scheduler/host_tier.py); the direction is the list it travels in."""

    device_page: int
    host_slot: int


@dataclass(frozen=True)
class SnapshotSpill:
    """Copy device checkpoint `checkpoint_id` (state and partial page) into host snapshot slot `host_slot`."""

    checkpoint_id: int
    host_slot: int


@dataclass(frozen=True)
class SnapshotLoad:
    """Copy host snapshot `host_slot` into a request's state slot and, when its prefix ends inside a
    page, its partial page's KV into device page `kv_page`."""

    host_slot: int
    state_slot: int
    kv_page: int | None


@dataclass(frozen=True)
class HostCopies:
    """One step's host-tier copies, in the order the runner runs them: spills before anything else in
    the step (their device pages and checkpoints may be overwritten by it), loads after the state
    saves (their slots and pages may have been a finished sequence's) and before the forward."""

    page_spills: tuple[PageCopy, ...] = ()
    snapshot_spills: tuple[SnapshotSpill, ...] = ()
    page_loads: tuple[PageCopy, ...] = ()
    snapshot_loads: tuple[SnapshotLoad, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.page_spills or self.snapshot_spills or self.page_loads or self.snapshot_loads)


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[
        int, ...
    ]  # the tokens computed this step, at positions start_pos... (PLACEHOLDER_TOKEN_ID: in flight)
    start_pos: int  # = num_computed_tokens before this step
    block_table: tuple[int, ...]  # pages covering positions [0, start_pos + len(token_ids))
    sample: bool  # the last token's logits are sampled (the request caught up with its tokens)
    new_request: NewRequestData | None = None
    state_slot: int | None = None  # hybrid models: the recurrent-state slot this request holds
    # Speculative decoding: the last this many of token_ids are draft tokens, verified this step
    # (their logits rows are sampled too; `sample` is then always set).
    num_draft_tokens: int = 0
    # Hybrid prefix caching: the checkpoint whose state (and, when start_pos is inside a page, whose
    # KV of that page) this request starts from, copied in before the forward.
    restore_checkpoint: int | None = None
    checkpoint_saves: tuple[CheckpointSave, ...] = ()  # positions in (start_pos, seq_len], ascending
    # Admitted this step (its first step, or its return after preemption): its block table is new,
    # not an extension of the one it last ran with (engine/input_batch.py rewrites its row).
    resumed: bool = False

    def __post_init__(self) -> None:
        assert self.token_ids, f"{self.request_id}: scheduled with no tokens"
        assert all(self.start_pos < s.num_tokens <= self.seq_len for s in self.checkpoint_saves), (
            f"{self.request_id}: a checkpoint outside this step's tokens"
        )

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache after this step."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    finished_request_ids: tuple[str, ...]  # ended since the last step: runner drops their state
    num_preempted: int = 0
    state_saves: tuple[StateSave, ...] = ()  # hybrid models: copied first, before any restore
    host_copies: HostCopies = HostCopies()  # --kv-offloading-size: the host tier's spills and loads
    # Async scheduling: the scheduler counted this step's tokens as computed when it scheduled them
    # and gave each sampling request a placeholder, which `Scheduler.update` fills.
    async_step: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class HostTierStats:
    """The host tier's report, in the scheduler's stats (counts now, and cumulative counters)."""

    num_pages: int
    num_used_pages: int
    num_snapshots: int
    num_used_snapshots: int
    page_bytes: int  # one page, every attention layer
    snapshot_bytes: int  # one snapshot: the DeltaNet state and a partial page
    hit_tokens: int = 0  # cumulative from here on
    queried_tokens: int = 0
    loaded_pages: int = 0
    spilled_pages: int = 0
    loaded_snapshots: int = 0
    spilled_snapshots: int = 0
    load_seconds: float = 0.0
    spill_seconds: float = 0.0

    @property
    def used_bytes(self) -> int:
        return self.num_used_pages * self.page_bytes + self.num_used_snapshots * self.snapshot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.num_snapshots * self.snapshot_bytes

    @property
    def loaded_bytes(self) -> int:
        return self.loaded_pages * self.page_bytes + self.loaded_snapshots * self.snapshot_bytes

    @property
    def spilled_bytes(self) -> int:
        return self.spilled_pages * self.page_bytes + self.spilled_snapshots * self.snapshot_bytes


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_blocks: int
    prefix_cache_queried_tokens: int  # cumulative
    prefix_cache_hit_tokens: int  # cumulative
    num_preemptions: int  # cumulative
    num_state_checkpoints: int = 0  # hybrid prefix caching: the pool's size
    num_used_state_checkpoints: int = 0
    fair_share: FairShareState = ()  # each key's virtual tokens (scheduler/fair_queue.py)
    fair_charged: FairShareState = ()  # what this core charged each key (data parallel: the front sums them)
    # For the front's admission (engine/front/admission.py): every request ever added (cumulative, so the
    # front can tell which of the requests it sent are counted here), and the tokens still to
    # compute of the waiting requests beyond the free batch slots (those the next step cannot start).
    num_added: int = 0
    num_queued_tokens: int = 0
    host: HostTierStats | None = None  # --kv-offloading-size

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks
