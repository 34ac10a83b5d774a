"""Per-token rate limits: a runaway client gets 429 with Retry-After, others are unaffected.

Counted in Django's cache (per process with the default local-memory cache; a shared cache such
as Redis makes the limit exact across web processes). Worker calls and management calls have
separate budgets, so a burst of dashboard-scripting cannot starve a team's workers.
"""

from __future__ import annotations

from django.conf import settings
from rest_framework.throttling import SimpleRateThrottle


class TokenRateThrottle(SimpleRateThrottle):
    def allow_request(self, request, view) -> bool:
        self.scope = getattr(view, "required_scope", None) or "manage"
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
