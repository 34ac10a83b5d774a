"""Failed sign-ins lock a user name, or a client address, out for a while; each is audited."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.test import Client
from django.utils import timezone

from apps.audit.models import AuditEvent
from tests.dashboard.conftest import PASSWORD, make_user

pytestmark = pytest.mark.django_db(transaction=True)

LOGIN = "/accounts/login/"
LOCKED = "Too many failed sign-ins"
WRONG = "That username and password do not match"


def sign_in(client: Client, username: str, password: str, address: str = "127.0.0.1"):
    return client.post(LOGIN, {"username": username, "password": password}, REMOTE_ADDR=address)


def signed_in(client: Client) -> bool:
    return client.get("/").status_code == 200


def test_a_hundred_wrong_passwords_lock_the_user_out_with_a_clear_message(db):
    make_user("pat")
    client = Client()
    answers = [sign_in(client, "pat", f"wrong-{i}") for i in range(100)]
    assert [a.status_code for a in answers[:5]] == [200] * 5
    assert all(WRONG in a.content.decode() for a in answers[:5])
    assert {a.status_code for a in answers[5:]} == {429}
    page = answers[-1].content.decode()
    assert LOCKED in page and "Try again in 15 minutes" in page
    assert 0 < int(answers[-1]["Retry-After"]) <= 900
    assert '<form method="post"' in page  # the sign-in page itself, with the reason in it
    # While locked out, even the right password is refused.
    right = sign_in(client, "pat", PASSWORD)
    assert right.status_code == 429 and LOCKED in right.content.decode()
    assert not signed_in(client)


def test_the_lockout_holds_from_every_address_and_for_every_spelling_of_the_name(db):
    make_user("pat")
    for i in range(5):
        sign_in(Client(), "pat", "wrong", address=f"192.0.2.{i}")
    for name in ["pat", "PAT"]:
        client = Client()
        assert sign_in(client, name, PASSWORD, address="198.51.100.77").status_code == 429
        assert not signed_in(client)


def test_failures_from_one_address_lock_that_address_out_for_every_user(db):
    make_user("pat")
    for i in range(20):
        assert sign_in(Client(), f"user-{i}", "wrong", "203.0.113.9").status_code == 200
    client = Client()
    assert sign_in(client, "pat", PASSWORD, "203.0.113.9").status_code == 429
    assert not signed_in(client)
    assert sign_in(client, "pat", PASSWORD, "198.51.100.2").status_code == 302
    assert signed_in(client)


def test_the_lockout_ends_when_its_window_passes(db):
    make_user("pat")
    start = timezone.now()
    with time_machine.travel(start, tick=False):
        for _ in range(5):
            sign_in(Client(), "pat", "wrong")
        assert sign_in(Client(), "pat", PASSWORD).status_code == 429
    with time_machine.travel(start + timedelta(seconds=899), tick=False):
        assert sign_in(Client(), "pat", PASSWORD).status_code == 429
    with time_machine.travel(start + timedelta(seconds=901), tick=False):
        client = Client()
        assert sign_in(client, "pat", PASSWORD).status_code == 302
        assert signed_in(client)
    # What left the window is deleted with the next failure.
    from apps.teams.models import SignInFailure

    with time_machine.travel(start + timedelta(seconds=902), tick=False):
        sign_in(Client(), "someone-else", "wrong")
    assert list(SignInFailure.objects.values_list("username", flat=True)) == ["someone-else"]


def test_a_right_password_forgets_that_addresses_typos(db):
    make_user("pat")
    client = Client()
    for _ in range(4):
        assert sign_in(client, "pat", "typo").status_code == 200
    assert sign_in(client, "pat", PASSWORD).status_code == 302
    client.post("/accounts/logout/")
    # Counted from zero again: five more failures before the lockout, not one.
    assert [sign_in(client, "pat", "typo").status_code for _ in range(6)] == [200] * 5 + [429]


def test_failed_sign_ins_and_the_lockout_are_audited(db):
    make_user("pat")
    for _ in range(7):
        sign_in(Client(), "pat", "wrong", "203.0.113.9")
    failed = AuditEvent.objects.filter(action="auth.login_failed")
    assert failed.count() == 5  # refusals while locked out write nothing
    event = failed.first()
    assert (event.team, event.target_type, event.target) == (None, "user", "pat")
    assert (event.actor, event.source, event.after) == (
        "203.0.113.9",
        "dashboard",
        {"address": "203.0.113.9"},
    )
    (locked,) = AuditEvent.objects.filter(action="auth.locked_out")
    assert (locked.team, locked.target) == (None, "pat")
    assert locked.after["lockedFor"] == "username" and locked.after["failures"] == 5


@pytest.mark.parametrize("path", [LOGIN, "/admin/login/"])
def test_a_name_longer_than_the_audit_holds_is_refused_as_any_wrong_name(db, path):
    name = "A" * 10_000
    answer = Client().post(path, {"username": name, "password": "x"})
    assert answer.status_code == 200  # the form again: it was a 500
    (event,) = AuditEvent.objects.filter(action="auth.login_failed")
    assert len(event.target) == 300 and event.target == "A" * 299 + "…"


def test_staff_find_failed_sign_ins_by_their_action_in_the_audit_trail(db):
    make_user("pat")
    sign_in(Client(), "pat", "wrong", "203.0.113.9")
    staff = Client()
    make_user("root", is_staff=True, is_superuser=True)
    assert sign_in(staff, "root", PASSWORD).status_code == 302
    page = staff.get("/audit", {"action": "auth.login_failed"}).content.decode()
    assert "auth.login_failed" in page and "203.0.113.9" in page
    assert "No changes match" not in page


def test_the_admin_sign_in_is_held_to_the_same_limits(db):
    make_user("root", is_staff=True, is_superuser=True)
    client = Client()
    for _ in range(5):
        client.post("/admin/login/", {"username": "root", "password": "wrong"})
    right = client.post("/admin/login/", {"username": "root", "password": PASSWORD})
    # The form again, not the redirect into the admin, saying why and for how long.
    assert right.status_code == 429 and 0 < int(right["Retry-After"]) <= 900
    assert LOCKED in right.content.decode() and 'id="login-form"' in right.content.decode()
    assert "_auth_user_id" not in client.session


def test_the_limits_follow_the_settings(db, settings):
    settings.SCHEDULER_LOGIN_FAILURES_PER_USER = 2
    settings.SCHEDULER_LOGIN_LOCKOUT_SECONDS = 60
    make_user("pat")
    # The clock stands still: on a busy machine a second could pass between the failures and
    # the last try, and the wait would then read "59 seconds".
    with time_machine.travel(timezone.now(), tick=False):
        statuses = [sign_in(Client(), "pat", "wrong").status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        assert "Try again in 1 minute." in sign_in(Client(), "pat", PASSWORD).content.decode()
