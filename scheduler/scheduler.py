"""The continuous-batching scheduler: each step, every request's computed tokens catch up with
its tokens inside a token budget — decodes first, then prefill chunks, then new arrivals — with
preemption by recompute (youngest first) when pages run out. One rule covers chunked prefill,
prefix-cache hits, resumption after preemption, and decode. Hybrid models' prefix-cache hits
restore a DeltaNet state checkpoint (scheduler/checkpoint_manager.py).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler.block_manager import BlockManager
from scheduler.checkpoint_manager import CheckpointManager
from scheduler.fair_queue import FairQueue, FairShareState, Policy
from scheduler.host_tier import HostHit, HostTier
from scheduler.output import (
    PLACEHOLDER_TOKEN_ID,
    HostCopies,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.slot_manager import SlotManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    num_state_slots: int = 0  # hybrid models: recurrent-state slots (0: the model keeps none)
    # Hybrid models with prefix caching: state checkpoints, and the density of the snapshots taken
    # inside long prefills (scheduler/checkpoint_manager.py `on_grid`; 0: none).
    num_state_checkpoints: int = 0
    state_checkpoint_bits: int = 0
    scheduling_policy: Policy = "fcfs"  # admission order of waiting requests (scheduler/fair_queue.py)
    long_prefill_token_threshold: int = 0  # most prefill tokens one request gets per step; 0: no cap
    # Speculative decoding: most draft tokens per decoding request and step (0: off), proposed
    # only while at most `speculative_max_batch` sequences run.
    num_speculative_tokens: int = 0
    speculative_max_batch: int = 0
    # Each request's draft length follows its acceptance: after a verify step that rejected a draft
    # it asks for one more draft than were accepted, after one that accepted all it asks for twice
    # as many (up to num_speculative_tokens). A rejected draft's row costs the step as much as an
    # accepted one's where the step is compute bound (CPU), so short drafts after a miss pay.
    speculative_adaptive: bool = False
    # --kv-offloading-size: the host tier's page and snapshot slots (0: no tier), and their bytes.
    num_host_pages: int = 0
    num_host_snapshots: int = 0
    host_page_bytes: int = 0
    host_snapshot_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must not be negative, got {self.long_prefill_token_threshold}"
            )
        if self.num_state_slots and self.enable_prefix_caching and self.num_state_checkpoints < 1:
            raise ValueError(
                "prefix caching on a hybrid model needs state checkpoints (the recurrent state at a prefix's end)"
            )


# (the request's id, its tokens so far, most drafts wanted) -> draft tokens: engine/spec_decode/ngram.py
# reads the tokens, engine/spec_decode/mtp.py the drafts it made for that request after the last step.
Drafter = Callable[[str, Sequence[int], int], list[int]]


def next_draft_len(current: int, drafted: int, accepted: int, most: int) -> int:
    """The drafts to ask for after a verify step (SchedulerConfig.speculative_adaptive)."""
    if accepted < drafted:
        return accepted + 1
    return min(most, max(current, 2 * drafted))


class Scheduler:
    def __init__(self, config: SchedulerConfig, drafter: Drafter | None = None) -> None:
        self.config = config
        self.drafter = drafter if config.num_speculative_tokens else None
        self._drafts: dict[str, list[int]] = {}  # this step's draft tokens, by request id
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.slots = SlotManager(config.num_state_slots) if config.num_state_slots else None
        self.checkpoints: CheckpointManager | None = None
        if config.num_state_slots and config.enable_prefix_caching:
            self.checkpoints = CheckpointManager(
                config.num_state_checkpoints, self.block_manager, config.state_checkpoint_bits
            )
        self.host: HostTier | None = None
        if config.num_host_pages and config.enable_prefix_caching:
            self.host = HostTier(
                config.num_host_pages,
                config.num_host_snapshots if self.checkpoints else 0,
                config.block_size,
                self.block_manager.cached.__contains__,
            )
            self.block_manager.host = self.host
            if self.checkpoints is not None:
                self.checkpoints.host = self.host
        self._restores: dict[str, int] = {}  # this step's restored checkpoint ids, by request id
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._sent_to_runner: set[str] = set()
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_added = 0  # requests ever added (the front's admission counts what it sent beyond this)
        self.num_prefix_queried_tokens = 0  # counted once per admission, not per lookup
        self.num_prefix_hit_tokens = 0
        self.fair = FairQueue(config.scheduling_policy)

    # ---- intake and removal ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        assert request.num_tokens < self.config.max_model_len, "prompt must leave room for a token"
        request.max_model_len = min(request.max_model_len, self.config.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.fair.on_add(request)
        self.num_added += 1

    def abort_request(self, request_id: str, keep_state: bool = True) -> Request | None:
        """End a request now and free its pages. Unknown or finished ids are ignored. keep_state:
        a hybrid sequence's state is kept as a checkpoint (False after a failed step: suspect)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.finish_reason = request.finish_reason or FinishReason.ABORT
        self._finish(request, keep_state)
        return request

    def _finish(self, request: Request, keep_state: bool = True) -> None:
        if keep_state:
            self._keep_state(request)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self._release(request)
        del self.requests[request.request_id]
        self.fair.on_remove(request)
        if request.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(request.request_id)
            self._finished_ids.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------------------------
    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the step in flight is read back (async
        scheduling): not when a step needs host knowledge of the tokens in flight (drafts, grammar
        masks, hybrid states and their checkpoints), nor when pages may run short, since preempting
        a request whose tokens are in flight would recompute tokens nobody knows yet."""
        if self.drafter is not None or self.slots is not None:
            return False
        if any(r.params.structured is not None for r in self.running):
            return False
        # Each running request grows by at most one page, plus the pages of the step's prefill.
        bs = self.config.block_size
        need = len(self.running) + -(-self.config.max_num_batched_tokens // bs)
        return self.block_manager.num_free_blocks >= need

    def schedule(self, async_step: bool = False) -> SchedulerOutput:
        """The next step. `async_step`: its tokens count as computed now and each sampling request
        gets a placeholder for its token (filled by `update`), so the step after it can be
        scheduled while it runs; such a step must not preempt a request with tokens in flight
        (the caller checks `can_schedule_ahead` first)."""
        budget = self.config.max_num_batched_tokens
        cap = self.config.long_prefill_token_threshold or budget  # per request per step
        num_new: dict[str, int] = {}
        scheduled: list[Request] = []
        num_preempted = 0

        self._drafts = {}
        self._restores = {}
        speculate = self.drafter is not None and len(self.running) <= self.config.speculative_max_batch
        # Decodes first, then running prefill chunks: a long prompt never stalls decoding.
        # A request whose placeholders reach its length limit finishes when they are read back.
        decoding = [
            r
            for r in self.running
            if r.num_tokens_with_placeholders - r.num_computed_tokens == 1
            and not (r.num_output_placeholders and r.at_length_limit)
        ]
        prefilling = [r for r in self.running if r.num_tokens_with_placeholders - r.num_computed_tokens > 1]
        for request in decoding + prefilling:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier this step
                continue
            n = min(request.num_tokens_with_placeholders - request.num_computed_tokens, budget, cap)
            drafts = self._propose(request, budget - 1) if speculate and n == 1 else []
            if drafts and self.block_manager.allocate(request, n, num_draft_tokens=len(drafts)):
                self._drafts[request.request_id] = drafts
                budget -= len(drafts)
                num_new[request.request_id] = n
                scheduled.append(request)
                budget -= n
                continue
            while not self.block_manager.allocate(request, n):
                victim = self._pick_victim(exclude=scheduled)
                assert not victim.num_output_placeholders, f"{victim.request_id}: preempted with tokens in flight"
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            num_new[request.request_id] = n
            scheduled.append(request)
            budget -= n

        # New arrivals and resumed requests, oldest first, when nothing was preempted. A request
        # whose grammar still compiles keeps its place and is passed over.
        skipped: list[Request] = []
        admitted: set[str] = set()
        bs = self.config.block_size
        # Hybrid: the pages this step computes (a prefix in them has no state to restore yet).
        in_flight = (
            {b for r in scheduled for b in r.block_table[r.num_computed_tokens // bs :]}
            if self.checkpoints is not None
            else set()
        )
        if (ordered := self.fair.order(self.waiting)) is not None:
            self.waiting = deque(ordered)
        while self.waiting and budget > 0 and num_preempted == 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.slots is not None and not self.slots.num_free_slots:
                break  # a hybrid sequence needs a state slot to run
            if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
                assert request.grammar_ready is not None, f"{request.request_id}: waits for no grammar"
                if not request.grammar_ready():
                    skipped.append(self.waiting.popleft())
                    continue
                request.status = RequestStatus.WAITING
            # A request wanting prompt logprobs computes every prompt position: no cache hit.
            lookup = not request.block_table and request.params.prompt_logprobs is None
            hit = self.block_manager.find_cached_prefix(request) if lookup else []
            # Past the device's pages: the host tier's, loaded into fresh pages (scheduler/host_tier.py).
            host = (
                self.host.lookup(request, len(hit), self.checkpoints is not None)
                if self.host is not None and lookup
                else HostHit()
            )
            num_cached = (len(hit) + len(host.host_slots)) * self.config.block_size
            restore = None
            if self.checkpoints is not None and lookup:  # hybrid: the hit ends where a state checkpoint is
                restore, num_cached = self.checkpoints.restore_point(request, hit, len(host.host_slots))
                if (
                    host.snapshot is not None
                    and self.host is not None
                    and (self.host.snapshot_tokens(host.snapshot) > num_cached)
                ):
                    restore, num_cached = None, self.host.snapshot_tokens(host.snapshot)
                    if request.checkpoint_junction <= num_cached:
                        request.checkpoint_junction = 0
                else:
                    host = HostHit(host.host_slots)
                if in_flight.intersection(hit[num_cached // bs :]):
                    # Its prefix is being computed this step (a user sharing a system prompt with
                    # one who arrived with it): wait a step and restore the state kept there.
                    skipped.append(self.waiting.popleft())
                    continue
                hit = hit[: num_cached // bs]
            n = min(request.num_tokens - request.num_computed_tokens - num_cached, budget, cap)
            # Pages for the cached tokens past the hit's full pages too (a checkpoint's partial page).
            if not self.block_manager.allocate(request, num_cached - len(hit) * bs + n, hit):
                break
            self.waiting.popleft()
            if self.slots is not None:
                self.slots.allocate(request)
            if restore is not None and self.checkpoints is not None:
                self.checkpoints.use(restore)
                self._restores[request.request_id] = restore.checkpoint_id
            if self.host is not None and lookup:
                self._load_from_host(request, len(hit), num_cached, host)
            if self.config.enable_prefix_caching:
                self.num_prefix_queried_tokens += request.num_tokens
                self.num_prefix_hit_tokens += num_cached
            if request.status is RequestStatus.WAITING and request.num_output_tokens == 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens += num_cached
            in_flight.update(request.block_table[num_cached // bs :])
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.add(request.request_id)
            num_new[request.request_id] = n
            scheduled.append(request)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        # Fairness charges the tokens the forward computes, drafts included: a rejected draft
        # still cost its key a query row.
        self.fair.charge(scheduled, {rid: n + len(self._drafts.get(rid, ())) for rid, n in num_new.items()})

        requests = tuple(self._describe(r, num_new[r.request_id], r.request_id in admitted) for r in scheduled)
        out = SchedulerOutput(
            requests=requests,
            finished_request_ids=tuple(self._finished_ids),
            num_preempted=num_preempted,
            # Copies of finished or preempted sequences' states ride with the next step that runs.
            state_saves=self.checkpoints.take_queued() if self.checkpoints is not None and requests else (),
            host_copies=self._host_copies(bool(requests)),
            async_step=async_step,
        )
        self._finished_ids = []
        if async_step:
            for r in scheduled:
                n = num_new[r.request_id]
                if r.num_computed_tokens + n == r.num_tokens_with_placeholders:
                    r.num_output_placeholders += 1
                r.num_computed_tokens += n
        return out

    def _load_from_host(self, request: Request, num_device_pages: int, num_cached: int, host: HostHit) -> None:
        """Order the host tier's copies for an admitted request: the pages its hit takes from the host
        (and the snapshot it restores), and count them."""
        assert self.host is not None
        slots = host.host_slots[: max(0, num_cached // self.config.block_size - num_device_pages)]
        self.host.load_pages(request, num_device_pages, slots)
        if host.snapshot is not None:
            self.host.load_snapshot(request, host.snapshot)
        self.host.num_queried_tokens += request.num_tokens - num_device_pages * self.config.block_size
        self.host.num_hit_tokens += (
            max(0, num_cached - num_device_pages * self.config.block_size) if slots or host.snapshot is not None else 0
        )

    def _host_copies(self, runs: bool) -> HostCopies:
        """The host tier's copies ride with a step that runs; otherwise they wait for one."""
        if self.host is None:
            return HostCopies()
        if runs:
            return self.host.take_copies()
        self.host.unpin()
        return HostCopies()

    def _propose(self, request: Request, room: int) -> list[int]:
        """Draft tokens for a decoding request: none past max_tokens, the context or the budget."""
        if not request.params.speculative:
            return []
        k = min(
            request.draft_len or self.config.num_speculative_tokens,
            room,
            request.max_model_len - request.num_tokens - 1,
        )
        if request.params.max_tokens is not None:
            k = min(k, request.params.max_tokens - request.num_output_tokens - 1)
        if k < 1:
            return []
        assert self.drafter is not None
        context = request.prompt_token_ids + request.output_token_ids
        return self.drafter(request.request_id, context, k)[:k]

    def _pick_victim(self, exclude: Sequence[Request]) -> Request:
        """The youngest running request not already scheduled this step."""
        candidates = [r for r in self.running if r not in exclude]
        assert candidates, "allocation failed with nothing left to preempt"
        return max(candidates, key=lambda r: r.arrival_time)

    def _preempt(self, request: Request) -> None:
        """Free the request's pages; it waits at the front and resumes by recompute (a hybrid
        sequence from the checkpoint of its state kept here, while its pages stay cached)."""
        self._keep_state(request)
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.checkpoint_junction = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _keep_state(self, request: Request) -> None:
        """Hybrid prefix caching: queue a checkpoint of the state a sequence's slot holds (after its
        computed tokens), unless that state is past its tokens (a stop inside accepted drafts)."""
        if (
            self.checkpoints is not None
            and request.state_slot is not None
            and 0 < request.num_computed_tokens <= request.num_tokens
        ):
            self.checkpoints.reserve_queued(request)

    def _release(self, request: Request) -> None:
        """Give back the request's pages and, for hybrid models, its state slot."""
        self.block_manager.free(request)
        if self.slots is not None:
            self.slots.free(request)

    def _describe(self, request: Request, n: int, resumed: bool) -> ScheduledRequest:
        start = request.num_computed_tokens
        new_data = None
        if request.request_id not in self._sent_to_runner:
            self._sent_to_runner.add(request.request_id)
            new_data = NewRequestData(request.params, tuple(request.prompt_token_ids), request.eos_token_ids)
        drafts = self._drafts.get(request.request_id, [])
        known = request.num_tokens
        token_ids = tuple(request.token_slice(start, min(start + n, known)))
        if start + n > known:  # tokens of the step in flight
            token_ids += (PLACEHOLDER_TOKEN_ID,) * (start + n - max(start, known))
        # Snapshots only of real tokens: a step verifying drafts may leave its state past them.
        saves = () if self.checkpoints is None or drafts else self.checkpoints.saves_for(request, start, start + n)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids + tuple(drafts),
            start_pos=start,
            block_table=tuple(request.block_table),
            sample=start + n == request.num_tokens_with_placeholders,
            new_request=new_data,
            state_slot=request.state_slot,
            num_draft_tokens=len(drafts),
            restore_checkpoint=self._restores.get(request.request_id),
            checkpoint_saves=saves,
            resumed=resumed,
        )

    def update(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int] | dict[str, Sequence[int]],
        rolled_back: frozenset[str] = frozenset(),
    ) -> list[Request]:
        """Advance the scheduled requests by the step's results; return those that sampled.

        `sampled` maps request id -> sampled token for the requests with `sample` set; a request
        that verified drafts maps to the tokens it emits (its accepted drafts, then one more).
        The KV of its rejected drafts is left behind as garbage past num_computed_tokens (the next
        step overwrites it) and their pages are returned. A `rolled_back` request (hybrid models:
        its recurrent state was put back to before this step) keeps its computed-token count, so
        its real and accepted tokens are recomputed next step. Requests aborted while the step ran
        are skipped (their pages are already free).
        """
        touched: list[Request] = []
        if self.checkpoints is not None:  # this step wrote them, whether or not their request lives on
            self.checkpoints.mark_ready([s.checkpoint_id for sr in output.requests for s in sr.checkpoint_saves])
        if output.async_step:
            return self._update_async(output, sampled)  # type: ignore[arg-type]
        for sr in output.requests:
            request = self.requests.get(sr.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if not sr.sample:
                request.num_computed_tokens += sr.num_new_tokens
                continue
            got = sampled[sr.request_id]
            tokens = (got,) if isinstance(got, int) else tuple(got)
            assert 1 <= len(tokens) <= sr.num_draft_tokens + 1, f"{sr.request_id}: {len(tokens)} tokens"
            # The real tokens, then the accepted drafts: their KV is now the request's.
            if sr.request_id not in rolled_back:
                request.num_computed_tokens += sr.num_new_tokens - sr.num_draft_tokens + len(tokens) - 1
            touched.append(request)
            if sr.num_draft_tokens and self.config.speculative_adaptive:
                request.draft_len = next_draft_len(
                    request.draft_len or self.config.num_speculative_tokens,
                    sr.num_draft_tokens,
                    len(tokens) - 1,
                    self.config.num_speculative_tokens,
                )
            for token in tokens:
                request.output_token_ids.append(token)
                if request.check_stop(token):
                    self._finish(request)
                    break
            else:
                if sr.num_draft_tokens:
                    self.block_manager.trim(request, request.num_tokens)
        return touched

    def _update_async(
        self, output: SchedulerOutput, sampled: dict[str, int] | dict[str, Sequence[int]]
    ) -> list[Request]:
        """An async step's tokens fill the placeholders it left (its computed tokens were counted
        when it was scheduled). A request that finished here may already run in the next step:
        that step's token for it is dropped when it comes back (the request is gone by then), and
        the KV it writes is of a real token, on pages the next step to reuse them runs after."""
        touched: list[Request] = []
        for sr in output.requests:
            request = self.requests.get(sr.request_id)
            if request is None or request.status is not RequestStatus.RUNNING or not sr.sample:
                continue
            got = sampled[sr.request_id]
            token = got if isinstance(got, int) else got[0]
            assert request.num_output_placeholders > 0, f"{sr.request_id}: a token without a placeholder"
            request.num_output_placeholders -= 1
            request.output_token_ids.append(token)
            touched.append(request)
            if request.check_stop(token):
                self._finish(request)
        return touched

    def finish_request(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a request for a reason found outside the scheduler (e.g. a stop string)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self._finish(request)

    def reset_prefix_cache(self) -> None:
        """Forget cached pages and state checkpoints (after a failed forward left them undefined)."""
        if self.checkpoints is not None:
            self.checkpoints.reset()
        if self.host is not None:
            self.host.reset()
        self.block_manager.reset_prefix_cache()

    def restore(self, last: SchedulerStats) -> None:
        """Carry on from a lost engine's last stats (engine/client/supervisor.py), before any request: its
        cumulative counters, so they never go back, and its fair-share counters, so a restart
        hands no key fresh credit."""
        assert not self.requests, "restored before the first request"
        self.num_preemptions = last.num_preemptions
        self.num_prefix_queried_tokens = last.prefix_cache_queried_tokens
        self.num_prefix_hit_tokens = last.prefix_cache_hit_tokens
        self.fair.restore(last.fair_share, last.fair_charged)
        if self.host is not None and last.host is not None:
            self.host.restore(last.host)

    def seed_fair_share(self, external: FairShareState) -> None:
        """Data parallel: what the other engine cores charged these keys (engine/client/global_fair_share.py),
        so that this core's admission order is fair over all of them."""
        self.fair.set_external(external)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        ck = self.checkpoints
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_used_blocks=bm.num_used_blocks,
            num_blocks=bm.num_blocks,
            prefix_cache_queried_tokens=self.num_prefix_queried_tokens,
            prefix_cache_hit_tokens=self.num_prefix_hit_tokens,
            num_preemptions=self.num_preemptions,
            num_state_checkpoints=ck.num_checkpoints if ck is not None else 0,
            num_used_state_checkpoints=ck.num_used if ck is not None else 0,
            fair_share=self.fair.snapshot(),
            fair_charged=self.fair.charged_snapshot(),
            num_added=self.num_added,
            num_queued_tokens=self._num_queued_tokens(),
            host=None
            if self.host is None
            else self.host.stats(self.config.host_page_bytes, self.config.host_snapshot_bytes),
        )

    def _num_queued_tokens(self) -> int:
        """Tokens still to compute of the waiting requests past the free batch slots, in queue order."""
        free = max(0, self.config.max_num_seqs - len(self.running))
        if len(self.waiting) <= free:
            return 0
        return sum(r.num_tokens - r.num_computed_tokens for r in itertools.islice(self.waiting, free, None))
