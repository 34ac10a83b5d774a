"""Production settings: `check --deploy` is clean, and a missing secret refuses to start."""

from __future__ import annotations

import importlib.util
import secrets

import pytest

from tests.conftest import manage


def test_check_deploy_is_clean_over_https():
    done = manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        SCHEDULER_HTTPS="true",
        SECRET_KEY=secrets.token_urlsafe(50),
        ALLOWED_HOSTS="scheduler.example.com",
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_https_without_a_secret_key_refuses_to_start():
    env = {"SCHEDULER_HTTPS": "true", "SECRET_KEY": ""}
    done = manage("check", **env)
    assert done.returncode != 0 and "SECRET_KEY must be set" in done.stderr


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("SCHEDULER_API_RATE_MANAGE", "fast", "must be a rate of at least 1 such as 20/s"),
        ("SCHEDULER_API_RATE_ENQUEUE", "0/s", "must be a rate of at least 1 such as 20/s"),
        ("SCHEDULER_DB_POOL_SIZE", "abc", "must be an integer"),
        ("SCHEDULER_DB_LOCK_TIMEOUT", "-1", "must be from 0 to 86400"),
        ("SCHEDULER_DEFAULT_LEASE_SECONDS", "0", "must be from 1 to 86400"),
        ("SCHEDULER_TICK_SECONDS", "-1", "must be from 0.01 to 3600"),
        ("SCHEDULER_TICK_SECONDS", "nan", "must be a finite number"),
        ("SCHEDULER_MAX_CLAIM", "0", "must be from 1 to 100000"),
        ("SCHEDULER_RETENTION_DAYS", "-3", "must be from 1 to 36600"),
        # Past what they are used in: PostgreSQL's lock_timeout (an int of milliseconds, so
        # every connection was refused), a date (every retention round failed).
        ("SCHEDULER_SHARD_LEASE_SECONDS", "99999999999999999999", "must be from 1 to 3600"),
        ("SCHEDULER_RETENTION_DAYS", "3000000", "must be from 1 to 36600"),
        ("SCHEDULER_NOTIFY_SENDERS", "0", "must be from 1 to 64"),
        ("SCHEDULER_SHARD_COUNT", "abc", "must be an integer"),
        ("LOG_LEVEL", "LOUD", "must be one of DEBUG"),
        ("LOG_RUNS_LEVEL", "loud", "must be one of DEBUG"),
        ("DEBUG", "maybe", "must be true or false"),
    ],
)
def test_a_bad_setting_refuses_to_start_naming_it(setting, value, says):
    """Each was taken before, and then failed every call (a rate), busy-looped (a negative
    tick), or ended in a traceback."""
    done = manage("check", **{setting: value})
    assert done.returncode != 0
    assert f"Configuration error: {setting} {says}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("setting", "folder", "kind", "says"),
    [
        ("PROMETHEUS_MULTIPROC_DIR", "missing", "an existing folder", "does not exist."),
        ("PROMETHEUS_MULTIPROC_DIR", "a-file", "an existing folder", "is not a folder."),
        ("SCHEDULER_DATA_DIR", "a-file", "a folder", "is not a folder."),
        ("SCHEDULER_DATA_DIR", "a-file/data", "a folder", "cannot be made: Not a directory."),
        # Absolute, so not under tmp_path: not even root makes a folder in /proc.
        ("SCHEDULER_DATA_DIR", "/proc/cronlease", "a folder", "cannot be made:"),
    ],
)
def test_a_folder_that_cannot_be_used_refuses_to_start_naming_it(
    tmp_path, setting, folder, kind, says
):
    """prometheus_client (reading PROMETHEUS_MULTIPROC_DIR when the metrics module imports it)
    and the static files' folder under SCHEDULER_DATA_DIR raised from deep inside: a long
    traceback that named no setting."""
    (tmp_path / "a-file").write_text("")
    path = tmp_path / folder
    done = manage("check", **{setting: str(path)})
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert (
        f"Configuration error: {setting} must be {kind} this process can write to; {path} {says}"
        in done.stderr
    )


@pytest.mark.skipif(
    importlib.util.find_spec("storages") is not None, reason="the s3 extra is installed"
)
def test_a_payload_bucket_without_its_storage_library_refuses_to_start():
    """Before, the first payload over 4 KB failed (a 500), and every one after it."""
    done = manage("check", SCHEDULER_PAYLOAD_BUCKET="payloads")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "Configuration error: SCHEDULER_PAYLOAD_BUCKET needs django-storages" in done.stderr


def test_sessions_expire_and_cookies_are_locked_down(settings):
    assert settings.SESSION_COOKIE_AGE <= 24 * 3600
    assert settings.SESSION_COOKIE_HTTPONLY and settings.X_FRAME_OPTIONS == "DENY"


def test_the_web_process_stops_on_a_bad_pool_setting():
    """Read in its worker processes alone, a bad value stopped each as it started, and the
    parent restarted them without end (14 tracebacks in 8 s), listening all the while."""
    done = manage("web", "--port", "0", timeout=60, SCHEDULER_DB_POOL_SIZE="abc")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "Configuration error: SCHEDULER_DB_POOL_SIZE must be an integer" in done.stderr


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://u:secret@127.0.0.1:notaport/db", "has a port that is not a number"),
        ("mysql://u:secret@127.0.0.1/db", "must be a postgresql:// URL"),
    ],
)
def test_a_bad_database_url_refuses_to_start_naming_it_not_its_password(url, says):
    """A port that is not a number ended in a traceback."""
    done = manage("check", DATABASE_URL=url)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"Configuration error: DATABASE_URL {says}" in done.stderr
    assert "secret" not in done.stderr
