"""Per-token rate limits: a runaway client gets 429 with Retry-After, others are unaffected.

Each budget is counted per token over a sliding period (class Window), in Django's cache. With
`REDIS_URL` set the cache is Redis, shared by every web process, and a token's limit holds
across them; without it each process counts its own (the limit is then per process). Worker
calls, management calls and runs created have separate budgets, so a burst of dashboard
scripting cannot starve a team's workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.conf import settings
from django.core.cache import cache
from rest_framework import exceptions
from rest_framework.throttling import BaseThrottle, SimpleRateThrottle

logger = logging.getLogger(__name__)


class Window:
    """A token's use of one budget, as a sliding window estimated from two fixed ones: the
    count of this period plus the last period's, weighted by the share of it still inside the
    sliding period. Past the rate at once, and no burst of twice the rate at a window's edge,
    at the cost of one read more than a fixed window."""

    def __init__(self, budget: str, token_pk: int, rate: str) -> None:
        self.allowed, period = SimpleRateThrottle.parse_rate(None, rate)  # it reads no state
        self.period = float(period)
        now = time.time()
        index = int(now // self.period)
        self.elapsed = now / self.period - index  # of this window, 0 to 1
        self.key = f"throttle:{budget}:{token_pk}:{index}"
        self.previous_key = f"throttle:{budget}:{token_pk}:{index - 1}"
        self.wait = 0.0  # once refused: seconds until the same amount would pass

    def spend(self, amount: int) -> bool:
        """Count `amount` against the budget; False (nothing counted, `wait` set) past it.
        True when the cache cannot be reached: a limit must not take the API down with it."""
        try:
            used, before = self._count(amount)
        except Exception:  # the cache client's own errors (redis-py's are not OSErrors)
            _cache_down()
            return True
        if used + before * (1 - self.elapsed) <= self.allowed:
            return True
        self.give_back(amount)
        room = self.allowed - used  # what this window's own count leaves
        if room < 0 or before == 0:
            self.wait = (1 - self.elapsed) * self.period
        else:  # when enough of the last window has slid out
            self.wait = max(0.0, (1 - room / before) - self.elapsed) * self.period
        self.wait = max(0.001, self.wait)
        return False

    def _count(self, amount: int) -> tuple[int, int]:
        # Kept through the next window too, which weighs it. add, then incr: each atomic in
        # the local-memory cache and in Redis.
        timeout = int(2 * self.period) + 1
        cache.add(self.key, 0, timeout=timeout)
        try:
            used = cache.incr(self.key, amount)
        except ValueError:  # expired between the two calls
            cache.add(self.key, 0, timeout=timeout)
            used = cache.incr(self.key, amount)
        return used, cache.get(self.previous_key, 0)

    def give_back(self, amount: int) -> None:
        if amount <= 0:
            return
        try:
            cache.decr(self.key, amount)
        except ValueError:  # the window has ended: nothing to give back
            pass
        except Exception:
            _cache_down()


_warned_at = float("-inf")


def _cache_down() -> None:
    """Say, at most once a minute per process, that rate limits are not counted."""
    global _warned_at
    if time.monotonic() - _warned_at >= 60:
        _warned_at = time.monotonic()
        logger.warning(
            "the cache is unreachable: per-token rate limits are not counted", exc_info=True
        )


class TokenRateThrottle(BaseThrottle):
    """Requests per token: SCHEDULER_API_RATE_WORKER for worker calls, _MANAGE for the rest
    (an enqueue is charged per run instead, by charge_enqueue)."""

    def __init__(self) -> None:
        self._wait: float | None = None

    def allow_request(self, request, view) -> bool:
        scope = getattr(view, "required_scope", None) or "manage"
        enqueue_methods = getattr(view, "enqueue_methods", ())
        if enqueue_methods and request.method in enqueue_methods:
            return True  # charged per run created (charge_enqueue), not per request
        rate = settings.SCHEDULER_API_RATES.get(scope)
        token = request.auth
        if not rate or token is None:
            return True
        window = Window(scope, token.pk, rate)
        if window.spend(1):
            return True
        self._wait = window.wait
        return False

    def wait(self) -> float | None:
        return self._wait


def charge_enqueue(token, runs: int) -> Callable[[int], None]:
    """Count `runs` against the token's enqueue budget (SCHEDULER_API_RATE_ENQUEUE, runs per
    period); past it, 429 with the seconds to the next period, and nothing is created.

    Producers create runs by the thousand in one request, so the budget counts runs, not
    requests. Items are charged before they are tried, so a request cannot create past the
    budget; the returned function gives back those that created nothing (an existing run, a
    refused item), since the budget counts runs created."""
    rate = settings.SCHEDULER_API_RATES.get("enqueue")
    if not rate or token is None:
        return _no_refund
    window = Window("enqueue", token.pk, rate)
    if not window.spend(runs):
        raise exceptions.Throttled(
            wait=window.wait,
            detail=f"More than {window.allowed} runs per {int(window.period)} s for this token.",
        )
    return window.give_back


def _no_refund(unused: int) -> None:
    return None
