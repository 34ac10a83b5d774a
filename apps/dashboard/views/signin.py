"""Sign-in: Django's LoginView, and the admin's, saying so when a lockout
(apps/teams/lockout.py) refused it (the reason in the form, 429 and Retry-After)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.decorators import login_not_required
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.exceptions import ValidationError
from django.forms.forms import NON_FIELD_ERRORS
from django.http import HttpRequest, HttpResponse

from apps.teams.lockout import LOCKED_OUT_ATTRIBUTE

LOCKED_OUT = (
    "Too many failed sign-ins for this username or from your address. Try again in %(wait)s."
)


class _SaysLockedOut:
    """A sign-in form whose refusal names the lockout, when one refused it."""

    request: HttpRequest | None

    def get_invalid_login_error(self) -> ValidationError:
        locked = getattr(self.request, LOCKED_OUT_ATTRIBUTE, None)
        if locked is None:
            return super().get_invalid_login_error()  # type: ignore[misc]
        return ValidationError(LOCKED_OUT, code="locked_out", params={"wait": locked.wait})


class SignInForm(_SaysLockedOut, AuthenticationForm):
    error_messages = {
        **AuthenticationForm.error_messages,
        "invalid_login": "That username and password do not match. Try again.",
    }


class AdminSignInForm(_SaysLockedOut, AdminAuthenticationForm):
    pass


def _back_off(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """The same page with the reason in the form; the status tells scripts to back off."""
    locked = getattr(request, LOCKED_OUT_ATTRIBUTE, None)
    if locked is not None and request.method == "POST":
        response.status_code = 429
        response["Retry-After"] = str(locked.seconds)
    return response


class SignInView(LoginView):
    authentication_form = SignInForm
    redirect_authenticated_user = True

    def form_invalid(self, form: SignInForm) -> HttpResponse:
        response = super().form_invalid(form)
        if form.has_error(NON_FIELD_ERRORS, "locked_out"):
            _back_off(self.request, response)
        return response


@login_not_required
def admin_sign_in(
    request: HttpRequest, extra_context: dict[str, Any] | None = None
) -> HttpResponse:
    """Django admin's sign-in (its form: AdminSignInForm, set in scheduler_site/urls.py), with
    the dashboard's lockout answer."""
    return _back_off(request, admin.site.login(request, extra_context))
