"""What the teams app tells other apps; apps/api/auth.py drops a revoked token from its cache."""

from __future__ import annotations

from django.dispatch import Signal

# Sent once a revocation is committed, with `token`, the ApiToken revoked.
token_revoked = Signal()
