"""`createteam` as scripts use it: the token alone on the last line of its output."""

from __future__ import annotations

from io import StringIO

import pytest

from apps.teams.models import ApiToken, Membership, Team
from tests.conftest import manage

pytestmark = pytest.mark.django_db(transaction=True)


def test_token_is_the_last_line_and_works(live_server):
    done = manage(
        "createteam", "payments", "--admin", "pat", "--password", "s3cret-pass",
        "--scopes", "worker,manage",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    token = done.stdout.strip().splitlines()[-1]
    assert token.startswith("jst_")
    team = Team.objects.get(slug="payments")
    assert Membership.objects.get(team=team).role == "admin"
    assert ApiToken.objects.get(team=team).scopes == ["manage", "worker"]
    import httpx

    answer = httpx.get(
        f"{live_server.url}/api/v1/jobs", headers={"Authorization": f"Bearer {token}"}
    )
    assert answer.status_code == 200


def test_bad_scope_is_refused(db):
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError):
        call_command("createteam", "ops", "--scopes", "root")
    assert not Team.objects.filter(slug="ops").exists()


@pytest.mark.parametrize(
    ("password", "reason"),
    [
        ("password123", "too common"),
        ("4815162342", "entirely numeric"),
        ("short1", "too short"),
        ("olga-admin", "too similar to the username"),
    ],
)
def test_a_weak_admin_password_is_refused_with_the_rule_it_breaks(db, password, reason):
    from django.contrib.auth import get_user_model
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match=reason):
        call_command("createteam", "ops", "--admin", "olga-admin", "--password", password)
    assert not Team.objects.filter(slug="ops").exists()
    assert not get_user_model().objects.filter(username="olga-admin").exists()


def test_a_password_without_an_admin_is_refused_and_one_for_an_existing_user_said_ignored(db):
    from django.contrib.auth import get_user_model
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="give --admin"):
        call_command("createteam", "ops", "--password", "a-Str0ng-passw0rd")
    assert not Team.objects.filter(slug="ops").exists()

    user = get_user_model().objects.create_user("olga", password="first-Passw0rd!")
    said = StringIO()
    call_command(
        "createteam", "ops", "--admin", "olga", "--password", "other-Passw0rd!", stderr=said,
        stdout=StringIO(),
    )  # fmt: skip
    user.refresh_from_db()
    assert user.check_password("first-Passw0rd!")
    assert "User olga exists: its password is left as it was" in said.getvalue()
    again = StringIO()
    call_command("createteam", "ops", stderr=again, stdout=StringIO())
    assert "Team ops exists: issuing it another token." in again.getvalue()
    assert ApiToken.objects.filter(team__slug="ops").count() == 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["a" * 65], "longer than 64 characters"),
        (["ops", "--name", "n" * 201], "--name is longer than 200 characters"),
        (["ops", "--admin", "a" * 151], "--admin is longer than 150 characters"),
        (["ops", "--admin", "bad user!"], "--admin: Enter a valid username"),
    ],
)
def test_createteam_refuses_what_its_columns_cannot_hold_before_writing(db, argv, says):
    from django.core.management import CommandError, call_command

    said = StringIO()
    with pytest.raises(CommandError, match=says):
        call_command("createteam", *argv, stderr=said, stdout=StringIO())
    assert "Created" not in said.getvalue()
    assert not Team.objects.exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["web", "--port", "99999"], "a whole number from 0 to 65535"),
        (["web", "--workers", "0"], "a whole number from 1 to 256"),
        (["scheduler", "--tick", "-1"], "--tick must be a number of seconds above 0"),
        (["scheduler", "--once", "--node-id", "n" * 201], "--node-id must be 1 to 200"),
        (["web", "--log-level", "loud"], "invalid choice: 'loud'"),
        (["dev", "--port", "99999", "--no-worker"], "--port must be a whole number"),
        (["reaper", "--interval", "nan"], "--interval must be a number of seconds above 0"),
        (["moveshard", "0", "--to", "postgresql://h/db", "--wait", "-5"], "--wait must be"),
    ],
)
def test_a_process_given_an_impossible_argument_says_so_and_does_not_start(argv, says):
    done = manage(*argv)
    assert done.returncode != 0 and says in done.stderr
    assert "Traceback" not in done.stderr
