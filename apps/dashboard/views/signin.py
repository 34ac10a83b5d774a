"""Sign-in: Django's LoginView, saying so when a lockout (apps/teams/lockout.py) refused it."""

from __future__ import annotations

from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.exceptions import ValidationError
from django.forms.forms import NON_FIELD_ERRORS
from django.http import HttpResponse

from apps.teams.lockout import LOCKED_OUT_ATTRIBUTE


class SignInForm(AuthenticationForm):
    error_messages = {
        **AuthenticationForm.error_messages,
        "invalid_login": "That username and password do not match. Try again.",
        "locked_out": (
            "Too many failed sign-ins for this username or from your address. "
            "Try again in %(wait)s."
        ),
    }

    def get_invalid_login_error(self) -> ValidationError:
        locked = getattr(self.request, LOCKED_OUT_ATTRIBUTE, None)
        if locked is None:
            return super().get_invalid_login_error()
        return ValidationError(
            self.error_messages["locked_out"], code="locked_out", params={"wait": locked.wait}
        )


class SignInView(LoginView):
    authentication_form = SignInForm
    redirect_authenticated_user = True

    def form_invalid(self, form: SignInForm) -> HttpResponse:
        response = super().form_invalid(form)
        locked = getattr(self.request, LOCKED_OUT_ATTRIBUTE, None)
        if locked is not None and form.has_error(NON_FIELD_ERRORS, "locked_out"):
            # The same page with the reason in the form; the status tells scripts to back off.
            response.status_code = 429
            response["Retry-After"] = str(locked.seconds)
        return response
