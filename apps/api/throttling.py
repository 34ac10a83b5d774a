"""Per-token rate limits: a runaway client gets 429 with Retry-After, others are unaffected.

Counted in Django's cache (per process with the default local-memory cache; a shared cache such
as Redis makes the limit exact across web processes). Worker calls and management calls have
separate budgets, so a burst of dashboard-scripting cannot starve a team's workers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from django.conf import settings
from django.core.cache import cache
from rest_framework import exceptions
from rest_framework.throttling import SimpleRateThrottle


class TokenRateThrottle(SimpleRateThrottle):
    def allow_request(self, request, view) -> bool:
        self.scope = getattr(view, "required_scope", None) or "manage"
        enqueue_methods = getattr(view, "enqueue_methods", ())
        if enqueue_methods and request.method in enqueue_methods:
            return True  # charged per run created (charge_enqueue), not per request
        self.rate = settings.SCHEDULER_API_RATES.get(self.scope)
        if not self.rate:
            return True
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)

    def get_rate(self) -> str | None:
        # The rate is chosen per view in allow_request; DRF calls this from __init__.
        return None

    def get_cache_key(self, request, view) -> str | None:
        token = request.auth
        if token is None:
            return None
        return f"throttle:{self.scope}:{token.pk}"


def charge_enqueue(token, runs: int) -> Callable[[int], None]:
    """Count `runs` against the token's enqueue budget (SCHEDULER_API_RATE_ENQUEUE, runs per
    period); past it, 429 with the seconds to the next period, and nothing is created.

    Producers create runs by the thousand in one request, so the budget counts runs, not
    requests: a fixed window per token in Django's cache (exact across processes with a shared
    cache such as Redis, per process otherwise). Items are charged before they are tried, so a
    request cannot create past the budget; the returned function gives back those that created
    nothing (an existing run, a refused item), since the budget counts runs created."""
    rate = settings.SCHEDULER_API_RATES.get("enqueue")
    if not rate or token is None:
        return _no_refund
    allowed, period = SimpleRateThrottle.parse_rate(None, rate)  # it reads no state
    now = time.time()
    window = int(now // period)
    key = f"throttle:enqueue:{token.pk}:{window}"
    cache.add(key, 0, timeout=int(period) + 1)
    used = cache.incr(key, runs)
    if used > allowed:
        cache.decr(key, runs)  # refused runs are not created, so they do not count
        raise exceptions.Throttled(
            wait=max(0.001, (window + 1) * period - now),
            detail=f"More than {allowed} runs per {int(period)} s for this token.",
        )

    def refund(unused: int) -> None:
        if unused > 0:
            with contextlib.suppress(ValueError):  # the window has ended: nothing to give back
                cache.decr(key, unused)

    return refund


def _no_refund(unused: int) -> None:
    return None
