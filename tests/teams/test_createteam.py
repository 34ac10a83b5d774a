"""`createteam` as scripts use it: the token alone on the last line of its output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.teams.models import ApiToken, Membership, Team
from tests.conftest import child_database_url

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.django_db(transaction=True)


def test_token_is_the_last_line_and_works(live_server):
    env = {
        **os.environ,
        "DATABASE_URL": child_database_url(),
    }
    done = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "createteam",
            "payments",
            "--admin",
            "pat",
            "--password",
            "s3cret-pass",
            "--scopes",
            "worker,manage",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
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
