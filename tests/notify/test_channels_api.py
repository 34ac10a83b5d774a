"""`/api/v1/channels` over real HTTP: create (secret shown once), read, change, test, the
delivery log, delete; another team's channel, bad input, limits and refused targets."""

from __future__ import annotations

import threading

import orjson
import pytest
from django.core.cache import cache
from django.db import connections

from apps.audit.models import AuditEvent
from apps.notify import channels
from apps.notify.models import Channel, Delivery
from tests.conftest import sent_behind_a_change
from tests.notify.conftest import make_channel, readme_verifier

pytestmark = pytest.mark.django_db(transaction=True)


def webhook(receiver, **fields) -> dict:
    return {
        "name": "pager",
        "kind": "webhook",
        "target": receiver.url,
        "events": ["run.dead", "job.recovered"],
        **fields,
    }


def test_a_webhook_channel_is_created_tested_logged_changed_and_deleted(api_a, receiver):
    created = api_a.post("/api/v1/channels", webhook(receiver, jobs=["billing.export"]))
    assert created.status_code == 201, created.text
    channel = created.json()
    secret = channel["secret"]
    assert secret.startswith("whsec_") and len(secret) > 40
    assert channel["jobs"] == ["billing.export"] and channel["queues"] == []
    base = f"/api/v1/channels/{channel['id']}"

    shown = api_a.get(base).json()
    assert "secret" not in shown and shown["target"] == receiver.url
    assert [c["name"] for c in api_a.get("/api/v1/channels").json()["results"]] == ["pager"]

    tested = api_a.post(f"{base}/test")
    assert tested.status_code == 200, tested.text
    delivery = tested.json()
    assert delivery["state"] == "sent" and delivery["lastStatus"] == 200
    assert delivery["attempts"] == 1 and delivery["attemptLog"][0]["ok"] is True
    (request,) = receiver.requests
    signature = request.headers["X-Cronlease-Signature"]
    assert readme_verifier()(secret, request.body, signature)
    assert not readme_verifier()("whsec_wrong", request.body, signature)
    body = orjson.loads(request.body)
    assert body["event"] == "test" and body["team"] == "team-a"
    assert body["url"] == "https://cronlease.example.test/teams/team-a"
    log = api_a.get(f"{base}/deliveries", params={"limit": 1}).json()
    assert [d["id"] for d in log["results"]] == [delivery["id"]] and log["next"] is None

    changed = api_a.patch(base, {"events": ["dlq.threshold"], "enabled": False})
    assert changed.status_code == 200, changed.text
    assert changed.json()["events"] == ["dlq.threshold"] and changed.json()["name"] == "pager"
    assert "secret" not in changed.json()
    kind = api_a.patch(base, {"kind": "email"})
    assert kind.status_code == 400 and "kind" in kind.json()["errors"]

    assert api_a.delete(base).status_code == 204
    assert not Channel.objects.exists() and not Delivery.objects.exists()
    actions = list(
        AuditEvent.objects.filter(target_type="channel")
        .order_by("pk")
        .values_list("action", "source")
    )
    assert actions == [
        ("channel.create", "api"),
        ("channel.test", "api"),
        ("channel.update", "api"),
        ("channel.delete", "api"),
    ]
    update = AuditEvent.objects.get(action="channel.update")
    assert update.before["events"] == ["run.dead", "job.recovered"]
    assert update.after["enabled"] is False


def test_a_slack_channels_new_url_on_the_same_host_is_audited_without_showing_it(
    api_a, team_a, receiver
):
    """The trail keeps a Slack URL as its host alone (the URL is the secret): a new URL on the
    same host compared equal, so sending the team's pages elsewhere left no event."""
    channel = make_channel(team_a, receiver.url + "/T1/B1/first", kind="slack")
    answer = api_a.patch(f"/api/v1/channels/{channel.pk}", {"target": receiver.url + "/T1/B1/new"})
    assert answer.status_code == 200, answer.text
    update = AuditEvent.objects.get(action="channel.update")
    assert update.before["target"] != update.after["target"]
    host = "/".join(receiver.url.split("/")[:3])  # scheme://host:port
    for kept in (update.before["target"], update.after["target"]):
        assert "/T1/" not in kept and kept.startswith(f"{host}/… (fingerprint "), kept


REFUSED = [
    "http://127.0.0.1:9/hook",
    "http://localhost:9/hook",
    "http://[::1]/hook",
    "http://169.254.169.254/latest/meta-data",
    "https://10.1.2.3/hook",
    "http://[::ffff:192.168.0.1]/",
    # IPv4 addresses inside IPv6 forms: NAT64 (the metadata service), 6to4, IPv4-compatible,
    # IPv4-translated (loopback, the metadata service), and NAT64's local-use prefix.
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://[2002:7f00:1::]/",
    "http://[::10.0.0.1]/",
    "http://[::ffff:0:127.0.0.1]/",
    "https://[::ffff:0:a9fe:a9fe]/latest",
    "http://[64:ff9b:1::808:808]/",
    "http://192.88.99.1/",  # the 6to4 relays' anycast
    # Not global, though Python 3.11's is_global says so: IETF protocol assignments, IPv6
    # site-local, IPv6 documentation, SRv6.
    "http://192.0.0.8/",
    "http://[fec0::1]/",
    "http://[3fff::1]/",
    "http://[5f00::1]/",
]


def test_other_teams_bad_input_limits_and_private_targets_are_refused(
    api_a, api_b, receiver, settings
):
    # Many calls in a second: throttling has tests of its own (tests/api/test_throttling.py).
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "", "enqueue": ""}
    cache.clear()
    # Another team's channel: a 404 whatever the call, audited.
    theirs = api_b.post("/api/v1/channels", webhook(receiver)).json()
    base = f"/api/v1/channels/{theirs['id']}"
    assert api_a.get(base).status_code == 404
    assert api_a.patch(base, {"name": "mine"}).status_code == 404
    assert api_a.delete(base).status_code == 404
    assert api_a.post(f"{base}/test").status_code == 404
    assert api_a.get(f"{base}/deliveries").status_code == 404
    assert api_a.get("/api/v1/channels").json()["results"] == []
    assert receiver.requests == [] and not Delivery.objects.exists()
    assert AuditEvent.objects.filter(action="access.denied").count() == 5
    for missing in ("99999999", "abc", "9" * 30):
        assert api_a.get(f"/api/v1/channels/{missing}").status_code == 404

    # Every bad field named at once; nothing written.
    bad = api_a.post(
        "/api/v1/channels",
        {"name": "", "kind": "pager", "target": "x", "events": ["run.exploded"], "jobs": ["A B"]},
    )
    assert bad.status_code == 400
    assert bad.headers["content-type"] == "application/problem+json"
    assert {"name", "kind", "events[0]", "jobs[0]"} <= set(bad.json()["errors"])
    mail = {"name": "mail", "kind": "email", "target": "not-an-address", "events": ["run.dead"]}
    answer = api_a.post("/api/v1/channels", mail)
    assert answer.json()["errors"] == {"target": ["Not a valid email address."]}
    # A name is taken as sent: one of spaces, or padded with them, is refused, not trimmed; so
    # is one with a tab or a right-to-left override (it would read as another name).
    for name in (
        "   ",
        " mail",
        "a\tb",
        "pager\u202eliam",
        "pay\u200fslack",
        "a\u061cb",
        "a\u200eb",
    ):
        answer = api_a.post("/api/v1/channels", {**mail, "name": name})
        assert answer.status_code == 400 and "name" in answer.json()["errors"], answer.text

    # A second channel of a name, and one past the team's limit.
    settings.SCHEDULER_NOTIFY_MAX_CHANNELS = 2
    mail["target"] = "ops@example.com"
    assert api_a.post("/api/v1/channels", mail).status_code == 201
    again = api_a.post("/api/v1/channels", mail)
    assert again.status_code == 400 and "name" in again.json()["errors"]
    assert api_a.post("/api/v1/channels", {**mail, "name": "mail-2"}).status_code == 201
    full = api_a.post("/api/v1/channels", {**mail, "name": "mail-3"})
    assert full.status_code == 400
    assert "SCHEDULER_NOTIFY_MAX_CHANNELS" in full.json()["errors"]["body"][0]

    # Loopback, private, link-local and mapped addresses, by name or number (SSRF).
    settings.SCHEDULER_NOTIFY_MAX_CHANNELS = 50
    settings.SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS = False
    for target in REFUSED:
        answer = api_a.post(
            "/api/v1/channels",
            {"name": "hook", "kind": "slack", "target": target, "events": ["run.dead"]},
        )
        assert answer.status_code == 400, (target, answer.text)
        (reason,) = answer.json()["errors"]["target"]
        assert "SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS" in reason, reason
    hook = {
        "name": "hook",
        "kind": "webhook",
        "target": "ftp://example.com/",
        "events": ["run.dead"],
    }
    assert api_a.post("/api/v1/channels", hook).json()["errors"]["target"] == [
        "An http:// or https:// URL."
    ]
    # A password in the URL would be read by every member: refused, not kept.
    with_password = {**hook, "target": "https://user:secret@example.com/hook"}
    (reason,) = api_a.post("/api/v1/channels", with_password).json()["errors"]["target"]
    assert reason.startswith("No user name or password in the URL")
    assert not Channel.objects.filter(name="hook").exists()
    settings.SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS = True
    allowed = api_a.post("/api/v1/channels", {**hook, "target": REFUSED[0]})
    assert allowed.status_code == 201, allowed.text
    # Hosts the socket library reads (full-width letters map to "localhost") but the HTTP
    # client refuses (IDNA 2008): saved, they failed every delivery as if worth retrying.
    for target in ("http://\uff2c\uff2f\uff23\uff21\uff2c\uff28\uff2f\uff33\uff34:8602/fw",
                   "http://\u24dbocalhost:8602/circ"):  # fmt: skip
        answer = api_a.post("/api/v1/channels", {**hook, "name": "idna", "target": target})
        assert answer.status_code == 400, (target, answer.text)
        (reason,) = answer.json()["errors"]["target"]
        assert reason.startswith("Not a valid URL"), reason


def test_creates_at_the_same_moment_do_not_pass_the_channel_cap(team_a, settings):
    settings.SCHEDULER_NOTIFY_MAX_CHANNELS = 3
    make_channel(team_a, "first@example.com", kind="email", name="first")
    start = threading.Barrier(6)
    outcomes: list[str] = []

    def create(n: int) -> None:
        try:
            start.wait()
            make_channel(team_a, f"c{n}@example.com", kind="email", name=f"c{n}")
            outcomes.append("created")
        except channels.ChannelError as exc:
            outcomes.append(exc.errors["body"][0])
        finally:
            connections.close_all()

    threads = [threading.Thread(target=create, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes).count("created") == 2
    assert all(o == "created" or o.startswith("A team has at most 3 channels") for o in outcomes)
    assert Channel.objects.filter(team=team_a).count() == 3


def test_a_patch_waiting_on_a_channel_deleted_meanwhile_is_a_404_and_never_brings_it_back(
    api_a, team_a, receiver
):
    """The PATCH read the channel before the DELETE committed; its save then found no row and
    inserted the channel again (with its old secret: it kept receiving pages)."""
    channel = make_channel(team_a, receiver.url)
    answer = sent_behind_a_change(
        channel.pk,
        "DELETE FROM notify_channel WHERE id = %s",
        lambda: api_a.patch(f"/api/v1/channels/{channel.pk}", {"enabled": False}),
    )
    assert answer.status_code == 404, answer.text
    assert not Channel.objects.filter(pk=channel.pk).exists()
    assert not AuditEvent.objects.filter(action="channel.update").exists()


def test_a_patch_waiting_on_a_channel_merges_into_what_another_change_left(api_a, team_a, receiver):
    """Two PATCHes at once, each naming a field: both hold (the one that waited merged into the
    channel as read before the other committed, and wrote its events back)."""
    channel = make_channel(team_a, receiver.url)
    answer = sent_behind_a_change(
        channel.pk,
        "UPDATE notify_channel SET events = ARRAY['run.dead', 'job.late'] WHERE id = %s",
        lambda: api_a.patch(f"/api/v1/channels/{channel.pk}", {"enabled": False}),
    )
    assert answer.status_code == 200, answer.text
    assert (answer.json()["enabled"], answer.json()["events"]) == (False, ["run.dead", "job.late"])
    channel.refresh_from_db()
    assert (channel.enabled, channel.events) == (False, ["run.dead", "job.late"])
