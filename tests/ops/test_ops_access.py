"""Who may read /metrics and /readyz: the monitoring networks, with the ops token when one is set.

/healthz stays open to everyone (load balancers probe it from anywhere).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

OPS_PATHS = ["/metrics", "/readyz"]
PUBLIC = "203.0.113.7"  # TEST-NET-3: never a private address
PROXY = "10.0.0.5"
TOKEN = "ops-token-7d1f9c"


def problem_status(answer) -> int:
    assert answer["Content-Type"] == "application/problem+json"
    body = answer.json()
    assert body["status"] == answer.status_code and body["detail"]
    return answer.status_code


@pytest.mark.parametrize("path", OPS_PATHS)
@pytest.mark.parametrize(
    "address", ["127.0.0.1", "::1", "10.1.2.3", "172.20.0.9", "192.168.1.10", "fd00::7", "::ffff:10.0.0.1"]
)  # fmt: skip
def test_loopback_and_private_networks_read_the_ops_endpoints_by_default(client, path, address):
    assert client.get(path, REMOTE_ADDR=address).status_code == 200


@pytest.mark.parametrize("path", OPS_PATHS)
@pytest.mark.parametrize("address", [PUBLIC, "8.8.8.8", "2001:db8::1", "", "unknown"])
def test_a_public_or_unknown_address_is_refused_with_403(client, path, address):
    assert problem_status(client.get(path, REMOTE_ADDR=address)) == 403


def test_healthz_stays_open_to_every_address(client):
    assert client.get("/healthz", REMOTE_ADDR=PUBLIC).json() == {"status": "ok"}


@pytest.mark.parametrize("path", OPS_PATHS)
def test_with_a_token_set_the_token_is_required_and_compared_exactly(client, settings, path):
    settings.SCHEDULER_OPS_TOKEN = TOKEN

    missing = client.get(path)
    assert problem_status(missing) == 401 and missing["WWW-Authenticate"].startswith("Bearer")
    assert problem_status(client.get(path, HTTP_AUTHORIZATION=f"Bearer {TOKEN}x")) == 401
    assert problem_status(client.get(path, HTTP_AUTHORIZATION=f"Basic {TOKEN}")) == 401
    assert problem_status(client.get(path, HTTP_AUTHORIZATION=TOKEN)) == 401
    assert client.get(path, HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    assert client.get(path, HTTP_AUTHORIZATION=f"bearer {TOKEN}").status_code == 200
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("path", OPS_PATHS)
def test_the_token_does_not_open_a_network_that_is_not_allowed(client, settings, path):
    settings.SCHEDULER_OPS_TOKEN = TOKEN
    auth = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}

    assert problem_status(client.get(path, REMOTE_ADDR=PUBLIC, **auth)) == 403
    settings.SCHEDULER_OPS_ALLOWED_NETWORKS = ["0.0.0.0/0", "::/0"]
    assert client.get(path, REMOTE_ADDR=PUBLIC, **auth).status_code == 200
    assert problem_status(client.get(path, REMOTE_ADDR=PUBLIC)) == 401


@pytest.mark.parametrize("path", OPS_PATHS)
def test_allowed_networks_replace_the_default(client, settings, path):
    settings.SCHEDULER_OPS_ALLOWED_NETWORKS = ["198.51.100.0/24"]

    assert client.get(path, REMOTE_ADDR="198.51.100.20").status_code == 200
    assert problem_status(client.get(path, REMOTE_ADDR="127.0.0.1")) == 403


@pytest.mark.parametrize("path", OPS_PATHS)
def test_forwarded_for_is_ignored_unless_behind_a_proxy(client, settings, path):
    settings.SCHEDULER_BEHIND_PROXY = False
    forged = {"REMOTE_ADDR": PUBLIC, "HTTP_X_FORWARDED_FOR": "10.0.0.1"}
    assert problem_status(client.get(path, **forged)) == 403


@pytest.mark.parametrize("path", OPS_PATHS)
def test_behind_a_proxy_the_address_the_proxy_appended_counts(client, settings, path):
    settings.SCHEDULER_BEHIND_PROXY = True

    via_proxy = {"REMOTE_ADDR": PROXY, "HTTP_X_FORWARDED_FOR": PUBLIC}
    assert problem_status(client.get(path, **via_proxy)) == 403
    # The client wrote the first entry itself; only the proxy's own (the last) is believed.
    forged = {"REMOTE_ADDR": PROXY, "HTTP_X_FORWARDED_FOR": f"10.0.0.1, {PUBLIC}"}
    assert problem_status(client.get(path, **forged)) == 403
    inside = {"REMOTE_ADDR": PROXY, "HTTP_X_FORWARDED_FOR": f"{PUBLIC}, 10.0.0.9"}
    assert client.get(path, **inside).status_code == 200
    # A probe that reaches the process directly (no proxy, no header) is judged by its own address.
    assert client.get(path, REMOTE_ADDR="10.0.0.9").status_code == 200
