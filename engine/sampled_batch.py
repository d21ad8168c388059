"""`SampledBatch`: one step's sampled ids (and logprobs) on the device, with their read-back to the
host deferred. The ids stay on the device for the next step's placeholders (async scheduling);
the read-back is the step's one host sync, into pinned memory on CUDA."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core_types import SampledToken


@dataclass(frozen=True)
class LogprobLayout:
    """Where the logprob rows sit in the packed tensor: rows `lp_rows` of the batch asked for
    logprobs, the top `num_top` of each, and each row wants `wanted[j]` of them."""

    lp_rows: tuple[int, ...] = ()
    num_top: int = 0
    wanted: tuple[int, ...] = ()


class SampledBatch:
    def __init__(self, token_ids: torch.Tensor, packed: torch.Tensor, layout: LogprobLayout) -> None:
        # [B] int64, device: the ids themselves, scattered into the next step's input_ids.
        self.token_ids = token_ids
        self.num_rows = int(token_ids.shape[0])
        self.layout = layout
        self._event: torch.cuda.Event | None = None
        if packed.device.type == "cuda":
            # One copy into pinned memory, waited for only when read: the stream runs on meanwhile.
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            packed = host
        self._packed = packed  # [B + L + 2 * L * N] float64: ids < 2^53 are exact

    def read(self) -> list[SampledToken]:
        """The host sync: one SampledToken per row."""
        if self._event is not None:
            self._event.synchronize()
        host: Sequence[float] = self._packed.tolist()
        num_rows, lay = self.num_rows, self.layout
        ids = [int(t) for t in host[:num_rows]]
        outputs = [SampledToken(token_id) for token_id in ids]
        num_lp, num_top = len(lay.lp_rows), lay.num_top
        top_ids_at, top_lps_at = num_rows + num_lp, num_rows + num_lp + num_lp * num_top
        for j, i in enumerate(lay.lp_rows):
            n = min(lay.wanted[j], num_top)
            row_ids = host[top_ids_at + j * num_top : top_ids_at + j * num_top + n]
            row_lps = host[top_lps_at + j * num_top : top_lps_at + j * num_top + n]
            outputs[i] = SampledToken(ids[i], host[num_rows + j], tuple(int(t) for t in row_ids), tuple(row_lps))
        return outputs
