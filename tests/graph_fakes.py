"""Stand-ins for CUDA-graph capture on CPU (engine/cuda_graph.py `GraphCapturer`): a "replay" re-runs
the captured function, which then reads whatever the runner and the backend's plan_graph() left in
their buffers. `StrictCapturer` also holds the function to what a real graph allows: no op that
reads a value back to the host or makes a shape from data, and a replay reads no tensor that was
not at an address the capture saw (a real replay would read the old address)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ForwardBatch

# Ops that read a device value back to the host, or whose output shape depends on data: inside a
# capture they fail (or sync), so none may run in a captured forward.
HOST_SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.item.default",
        "aten.nonzero.default",
        "aten.nonzero_static.default",
        "aten.masked_select.default",
        "aten.bincount.default",
        "aten.unique_consecutive.default",
        "aten._unique2.default",
        "aten.unique_dim.default",
        "aten.repeat_interleave.Tensor",
        "aten.histc.default",
        "aten.equal.default",
        "aten.is_nonzero.default",
    }
)


class GraphableTorchBackend(TorchAttentionBackend):
    """The torch reference with the graph hooks (decode and verify steps): its plan_graph() is its
    host plan, which a CPU "replay" then reads."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.prepared: tuple[tuple[int, ...], int] | None = None
        self.prepared_verify: tuple[tuple[int, ...], int, int] | None = None
        self.graph_plans: list[int] = []

    def prepare_graphs(self, batch_sizes: Sequence[int], max_num_pages: int) -> None:
        self.prepared = (tuple(batch_sizes), max_num_pages)

    def prepare_verify_graphs(self, batch_sizes: Sequence[int], query_len: int, max_num_pages: int) -> None:
        self.prepared_verify = (tuple(batch_sizes), query_len, max_num_pages)

    def plan_graph(self, batch: ForwardBatch) -> None:
        self.graph_plans.append(batch.num_requests)
        self.plan(batch)

    def plan_storages(self) -> set[int]:
        """The storages of this stand-in's host plan, rebuilt by every plan_graph(): FlashInfer's
        graph wrappers copy theirs into fixed buffers, which this stand-in does not model."""
        found: set[int] = set()

        def walk(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                found.add(_storage(value))
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v)
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                for f in dataclasses.fields(value):
                    walk(getattr(value, f.name))

        for value in vars(self).values():
            walk(value)
        return found


class ReplayByRerun:
    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn().clone()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.output.copy_(self.fn())


class FakeCapturer:
    def __init__(self) -> None:
        self.graphs: list[ReplayByRerun] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> ReplayByRerun:
        self.graphs.append(ReplayByRerun(fn))
        return self.graphs[-1]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else 0


class _Watch(TorchDispatchMode):
    """Records the storages a run reads that it did not make itself, and every host-syncing op."""

    def __init__(self, allowed: set[int] | None) -> None:
        super().__init__()
        self.allowed = allowed  # None: capturing; else the storages the capture read
        self.external: set[int] = set()
        self.made: set[int] = set()
        self.syncs: list[str] = []
        self.stale: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if name in HOST_SYNC_OPS or (name == "aten.index.Tensor" and any(t.dtype == torch.bool for t in inputs[1:])):
            self.syncs.append(name)
        for t in inputs:
            ptr = _storage(t)
            if ptr and ptr not in self.made:
                self.external.add(ptr)
                if self.allowed is not None and ptr not in self.allowed:
                    self.stale.append(f"{name} {tuple(t.shape)} {t.dtype}")
        out = func(*args, **kwargs)
        self.made.update(_storage(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


class StrictReplay:
    def __init__(self, fn: Callable[[], torch.Tensor], exempt: Callable[[], set[int]]) -> None:
        self.fn = fn
        self.exempt = exempt
        watch = _Watch(None)
        with watch:
            self.output = fn().clone()
        self.capture_syncs = watch.syncs
        self.addresses = watch.external
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        watch = _Watch(self.addresses | self.exempt())
        with watch:
            out = self.fn()
        assert not watch.syncs, f"a replay ran host-syncing ops: {watch.syncs}"
        assert not watch.stale, f"a replay read tensors the capture never saw: {watch.stale[:5]}"
        self.output.copy_(out)


class StrictCapturer:
    """exempt: storages a replay may read at new addresses (a stand-in backend's host plan)."""

    def __init__(self, exempt: Callable[[], set[int]] = set) -> None:
        self.exempt = exempt
        self.graphs: list[StrictReplay] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> StrictReplay:
        graph = StrictReplay(fn, self.exempt)
        assert not graph.capture_syncs, f"the captured forward ran host-syncing ops: {graph.capture_syncs}"
        self.graphs.append(graph)
        return graph
