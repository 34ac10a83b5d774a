"""The demo's sign-in (`demo` / `demo-password`) passes the site's password rules."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password

from apps.demo.data import PASSWORD, USERNAME


def test_the_demo_password_passes_the_password_validators():
    validate_password(PASSWORD, get_user_model()(username=USERNAME))
