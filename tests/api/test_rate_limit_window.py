"""The tokens-per-minute window of api/access/rate_limit.py on an injected clock: a refused key's
Retry-After is the true time until it reopens (to the second it is rounded up to), also when the
key has been busy for longer than one window, and x-ratelimit-reset-tokens is the time until the
window is empty."""

from __future__ import annotations

import random

import pytest

from api.access.keys import KeyRecord
from api.access.rate_limit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.used = 0  # the key's cumulative tokens, as the output processor counts them

    def limiter(self) -> RateLimiter:
        return RateLimiter(lambda name: self.used, clock=lambda: self.now)


def run_request(clock: Clock, limiter: RateLimiter, key: KeyRecord, start: float, end: float, tokens: int) -> None:
    clock.now = start
    assert limiter.acquire(key) is None, f"refused at {start}"
    clock.now, clock.used = end, clock.used + tokens
    limiter.release(key)


def test_retry_after_counts_from_the_tokens_still_in_the_window_after_a_busy_minute() -> None:
    clock = Clock()
    limiter, key = clock.limiter(), KeyRecord("a", tpm=100)
    run_request(clock, limiter, key, 0, 10, 60)
    run_request(clock, limiter, key, 70, 80, 70)  # the first 60 left the window at 70
    run_request(clock, limiter, key, 100, 110, 70)  # 140 tokens in the window (at 80 and 110)
    clock.now = 115
    refused = limiter.acquire(key)
    assert refused is not None and refused.status_code == 429
    # The 70 counted at 80 leave at 140: 70 < 100 are left, so the key reopens then.
    assert refused.headers["retry-after"] == "25"
    assert refused.headers["x-ratelimit-reset-tokens"] == "55s"  # the last 70 leave at 170
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    clock.now = 139.5
    assert limiter.acquire(key) is not None
    clock.now = 140
    assert limiter.acquire(key) is None


def test_admitted_requests_carry_the_time_until_the_window_is_empty() -> None:
    clock = Clock()
    limiter, key = clock.limiter(), KeyRecord("a", tpm=100)
    clock.now = 0
    assert limiter.headers(key)["x-ratelimit-remaining-tokens"] == "100"
    run_request(clock, limiter, key, 0, 5, 30)
    clock.now = 20
    headers = limiter.headers(key)
    assert headers["x-ratelimit-remaining-tokens"] == "70"
    assert headers["x-ratelimit-reset-tokens"] == "45s"


@pytest.mark.parametrize("seed", range(20))
def test_retry_after_is_the_true_reopening_to_the_second(seed: int) -> None:
    """Random traffic: whenever a key is refused for tokens, it is still refused one second before
    its Retry-After and admitted at it."""
    rng = random.Random(seed)
    clock = Clock()
    limiter, key = clock.limiter(), KeyRecord("a", tpm=rng.choice([50, 200, 1000]))
    t, checked = 0.0, 0
    while t < 400:
        t += rng.uniform(0.5, 20.0)
        clock.now = t
        refused = limiter.acquire(key)
        if refused is None:
            clock.now = t = t + rng.uniform(0.1, 15.0)
            clock.used += rng.randint(1, 2 * key.tpm)
            limiter.release(key)
            continue
        retry_after = int(refused.headers["retry-after"])
        if retry_after > 1:
            clock.now = t + retry_after - 1
            assert limiter.acquire(key) is not None, f"admitted a second before Retry-After {retry_after} at {t}"
        clock.now = t = t + retry_after
        assert limiter.acquire(key) is None, f"still refused after Retry-After {retry_after} at {t}"
        limiter.release(key)
        checked += 1
    assert checked > 0
