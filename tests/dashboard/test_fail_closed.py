"""The dashboard fails closed: a view that forgets its own check still needs a signed-in user."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


@pytest.mark.urls("tests.dashboard.forgotten_urls")
def test_a_view_without_a_check_still_needs_sign_in(client, django_user_model):
    answer = client.get("/forgotten")
    assert answer.status_code == 302 and answer["Location"].startswith("/accounts/login/")
    htmx = client.get("/forgotten", HTTP_HX_REQUEST="true")
    assert htmx.status_code == 200 and htmx["HX-Redirect"] == "/accounts/login/"
    user = django_user_model.objects.create_user("someone", password="pw-123456789")
    client.force_login(user)
    assert client.get("/forgotten").content == b"secret"


def test_machine_endpoints_stay_open_to_their_own_auth(client):
    assert client.get("/healthz").status_code == 200
    assert client.get("/api/v1/jobs").status_code == 401  # the API's own answer, not a redirect
    assert client.get("/metrics").status_code == 200
    assert client.get("/accounts/login/").status_code == 200
