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
from rest_framework import exceptions, status
from rest_framework.throttling import BaseThrottle, SimpleRateThrottle

logger = logging.getLogger(__name__)


# A period is counted in this many slices: the count over the last period is the slices inside
# it plus the share of the oldest one still inside, so at most 1/SLICES of the rate more than it
# can pass in any period (two halves weighted as one let 1.8 times the rate through at an edge).
SLICES = 10


class Window:
    """A token's use of one budget over the last period, counted in SLICES slices of it."""

    def __init__(self, budget: str, token_pk: int, rate: str) -> None:
        self.allowed, period = SimpleRateThrottle.parse_rate(None, rate)  # it reads no state
        self.period = float(period)
        self.slice = self.period / SLICES
        position = time.time() / self.slice
        index = int(position)
        self.elapsed = position - index  # of the current slice, 0 to 1
        prefix = f"throttle:{budget}:{token_pk}:"
        self.key = f"{prefix}{index}"
        # Oldest first: the slice the period began in, then the rest up to the current one.
        self.keys = [f"{prefix}{index - back}" for back in range(SLICES, 0, -1)]
        self.wait = 0.0  # once refused: seconds until the same amount would pass

    def spend(self, amount: int) -> bool:
        """Count `amount` against the budget; False (nothing counted, `wait` set) past it.
        True when the cache cannot be reached: a limit must not take the API down with it."""
        try:
            counts = self._count(amount)
        except Exception:  # the cache client's own errors (redis-py's are not OSErrors)
            _cache_down()
            return True
        if counts[0] * (1 - self.elapsed) + sum(counts[1:]) <= self.allowed:
            return True
        self.give_back(amount)
        counts[-1] -= amount
        self.wait = max(0.001, self._until_room(counts, amount))
        return False

    def _until_room(self, counts: list[int], amount: int) -> float:
        """Seconds until `amount` more fits, as the oldest slices slide out (if nothing else
        is spent meanwhile)."""
        for step in range(len(counts)):
            oldest, rest = counts[step], sum(counts[step + 1 :]) + amount
            if rest > self.allowed:
                continue  # this slice slides out whole before there is room
            start = self.elapsed if step == 0 else 0.0
            share = 1 - (self.allowed - rest) / oldest if oldest else 0.0
            return (step + max(start, share) - self.elapsed) * self.slice
        return (len(counts) - self.elapsed) * self.slice

    def _count(self, amount: int) -> list[int]:
        """The counts of the period's slices, oldest first, once `amount` is added to the
        current one. add, then incr: each atomic in the local-memory cache and in Redis."""
        timeout = int(self.period + 2 * self.slice) + 1  # while a period still weighs it
        cache.add(self.key, 0, timeout=timeout)
        try:
            used = cache.incr(self.key, amount)
        except ValueError:  # expired between the two calls
            cache.add(self.key, 0, timeout=timeout)
            used = cache.incr(self.key, amount)
        found = cache.get_many(self.keys)
        return [int(found.get(key, 0)) for key in self.keys] + [used]

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


class BatchOverRate(exceptions.APIException):
    """A bulk enqueue of more runs than the token may create in a whole period: it could never
    pass, so it is not a 429 to wait out."""

    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "batch-over-rate"


def charge_enqueue(token, runs: int) -> Callable[[int], None]:
    """Count `runs` against the token's enqueue budget (SCHEDULER_API_RATE_ENQUEUE, runs per
    period); past it, 429 with the seconds until they fit, and nothing is created. More runs
    than a whole period allows could never fit: a 400 (batch-over-rate).

    Producers create runs by the thousand in one request, so the budget counts runs, not
    requests. Items are charged before they are tried, so a request cannot create past the
    budget; the returned function gives back those that created nothing (an existing run, a
    refused item), since the budget counts runs created."""
    rate = settings.SCHEDULER_API_RATES.get("enqueue")
    if not rate or token is None:
        return _no_refund
    window = Window("enqueue", token.pk, rate)
    if runs > window.allowed:
        raise BatchOverRate(
            f"{runs} runs are more than this token may create in {int(window.period)} s "
            f"({window.allowed}): send at most {window.allowed} a request."
        )
    if not window.spend(runs):
        raise exceptions.Throttled(
            wait=window.wait,
            detail=f"More than {window.allowed} runs per {int(window.period)} s for this token.",
        )
    return window.give_back


def _no_refund(unused: int) -> None:
    return None
