"""Per-key rate and concurrency limits (`rpm`, `tpm`, `max_concurrent` in the keys file).

A request over a limit is answered 429 before its body is read, so it costs and holds nothing:
Retry-After, OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} headers, and a body in
OpenAI's shape with code `rate_limit_exceeded` (Anthropic's `rate_limit_error` on /v1/messages, re-shaped
by api/access/keys.py). Admitted requests carry the same headers.

Windows slide over the last 60 s. Requests count when admitted. Tokens (prompt + completion) count
as the output processor sees them (engine/front/metrics.py `usage`, read through `tokens_used`): a key
that has used its `tpm` in the last minute is refused until enough of those tokens have left the
window (Retry-After says when); a request already running is never cut off.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Callable

from starlette.responses import Response

from api.access.keys import KeyRecord
from api.errors import error_response
from api.transport.metrics import ServerMetrics

WINDOW_S = 60.0


def format_reset(seconds: float) -> str:
    """OpenAI's duration style: 20ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{max(int(seconds * 1000), 1)}ms"
    s = math.ceil(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


class RateLimiter:
    """Touched on the event loop only."""

    def __init__(
        self,
        tokens_used: Callable[[str], int],
        metrics: ServerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tokens_used = tokens_used  # key name -> prompt + completion tokens since start
        self._metrics = metrics
        self._clock = clock
        self._requests: dict[str, deque[float]] = defaultdict(deque)  # admission times in the window
        self._token_marks: dict[str, deque[tuple[float, int]]] = defaultdict(deque)  # (time, cumulative)
        self.in_flight: dict[str, int] = defaultdict(int)

    # ---- the windows ----------------------------------------------------------------------------
    def _prune(self, record: KeyRecord, now: float) -> None:
        name = record.name
        requests = self._requests[name]
        while requests and requests[0] <= now - WINDOW_S:
            requests.popleft()
        if record.tpm is None:
            return
        marks = self._token_marks[name]
        used = self._tokens_used(name)
        if not marks or marks[-1][1] != used:  # a mark that adds no tokens changes no answer
            marks.append((now, used))
        # Keep one mark at or before the window's start: the baseline the window's tokens count from.
        while len(marks) > 1 and marks[1][0] <= now - WINDOW_S:
            marks.popleft()

    def _token_window(self, name: str, tpm: int, now: float) -> tuple[int, float, float]:
        """(tokens used in the window, seconds until fewer than `tpm` are, seconds until none are).

        Mark i's tokens (cumulative_i - cumulative_{i-1}) count from its time t_i and leave the
        window at t_i + WINDOW_S; the key reopens once the tokens after some mark are under `tpm`."""
        marks = self._token_marks[name]
        if len(marks) < 2:
            return 0, 0.0, 0.0
        (_, base), (last_time, last) = marks[0], marks[-1]
        reopen = 0.0
        if last - base >= tpm:
            reopen_time = next(t for t, cumulative in list(marks)[1:] if last - cumulative < tpm)
            reopen = max(reopen_time + WINDOW_S - now, 0.0)
        empty = max(last_time + WINDOW_S - now, 0.0) if last > base else 0.0
        return last - base, reopen, empty

    # ---- a request --------------------------------------------------------------------------------
    def acquire(self, record: KeyRecord) -> Response | None:
        """None: admitted (call `release` when it ends); else the 429 to send."""
        name, now = record.name, self._clock()
        self._prune(record, now)
        if record.max_concurrent is not None and self.in_flight[name] >= record.max_concurrent:
            return self._refuse(record, "requests", f"{record.max_concurrent} concurrent requests", 1.0)
        requests = self._requests[name]
        if record.rpm is not None and len(requests) >= record.rpm:
            return self._refuse(record, "requests", f"{record.rpm} requests per minute", requests[0] + WINDOW_S - now)
        if record.tpm is not None:
            used, reopen, _ = self._token_window(name, record.tpm, now)
            if used >= record.tpm:
                return self._refuse(record, "tokens", f"{record.tpm} tokens per minute", reopen)
        if record.rpm is not None:  # NOTE: a key without the limit keeps no window
            requests.append(now)
        self.in_flight[name] += 1
        return None

    def release(self, record: KeyRecord) -> None:
        self.in_flight[record.name] -= 1
        self._prune(record, self._clock())

    def headers(self, record: KeyRecord) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the key's configured limits."""
        now = self._clock()
        out = {}
        if record.rpm is not None:
            requests = self._requests[record.name]
            out["x-ratelimit-limit-requests"] = str(record.rpm)
            out["x-ratelimit-remaining-requests"] = str(max(record.rpm - len(requests), 0))
            out["x-ratelimit-reset-requests"] = format_reset(requests[0] + WINDOW_S - now if requests else 0.0)
        if record.tpm is not None:
            used, _, empty = self._token_window(record.name, record.tpm, now)
            out["x-ratelimit-limit-tokens"] = str(record.tpm)
            out["x-ratelimit-remaining-tokens"] = str(max(record.tpm - used, 0))
            # OpenAI's meaning: until the limit is back to its initial state (the window empty).
            out["x-ratelimit-reset-tokens"] = format_reset(empty)
        return out

    def _refuse(self, record: KeyRecord, kind: str, what: str, retry_after_s: float) -> Response:
        if self._metrics is not None:
            self._metrics.rejected.labels(reason="rate_limited").inc()
        headers = {"Retry-After": str(max(math.ceil(retry_after_s), 1)), **self.headers(record)}
        message = f"rate limit reached for key {record.name!r}: {what}; retry after {headers['Retry-After']}s"
        return error_response(429, message, code="rate_limit_exceeded", headers=headers, type_=kind)
