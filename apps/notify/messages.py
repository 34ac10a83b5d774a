"""What a notification says: the webhook's JSON body, and the Slack and email renderings of it.

The body is built once, when the delivery is written to the outbox, and kept as the exact bytes
sent (and signed), so every retry sends the same message.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import orjson
from django.conf import settings

from apps.runs.clock import format_utc

# open: the first page of an incident; reminder: it is still open; resolved: it closed; test: the
# "send test" button.
PHASES = ("open", "reminder", "resolved", "test")

TITLES = {
    "run.dead": "a run is dead",
    "job.late": "a run is late",
    "job.missed": "a cron time was missed",
    "dlq.threshold": "the dead-letter queue is over its threshold",
    "scheduler.shard_unowned": "shards have no scheduler",
    "job.recovered": "recovered",
    "test": "test message",
}


def link(path: str) -> str:
    """An absolute link to a dashboard page, under SCHEDULER_PUBLIC_URL."""
    return settings.SCHEDULER_PUBLIC_URL + path


def url_for(event: str, team_slug: str, job: str, run_id: str) -> str:
    if run_id:
        return link(f"/runs/{quote(run_id)}")
    if job:
        return link(f"/jobs/{quote(job)}")
    if event == "dlq.threshold":
        return link(f"/dlq?team={quote(team_slug)}")
    if event == "test":
        return link(f"/teams/{quote(team_slug)}")
    return link("/")


def body(
    *,
    event: str,
    phase: str,
    team_slug: str,
    summary: str,
    at,
    job: str = "",
    queue: str = "",
    run_id: str = "",
    incident: Any = None,
) -> str:
    """The webhook body (JSON text): `event`, `team`, `job`, `runId`?, `at`, `summary`, `url`,
    and `phase`, `queue` and the `incident` it belongs to."""
    data: dict[str, Any] = {
        "event": event,
        "phase": phase,
        "team": team_slug,
        "job": job or None,
    }
    if run_id:
        data["runId"] = run_id
    data |= {
        "queue": queue or None,
        "at": format_utc(at),
        "summary": summary,
        "url": url_for(event, team_slug, job, run_id),
    }
    if incident is not None:
        data["incident"] = {
            "id": incident.pk,
            "event": incident.event,
            "subject": incident.subject,
            "openedAt": format_utc(incident.opened_at),
            "closedAt": format_utc(incident.closed_at),
            "occurrences": incident.occurrences,
        }
    return orjson.dumps(data).decode()


def title(data: dict[str, Any]) -> str:
    """One line naming the message: "[team-a] run.dead billing.export: a run is dead"."""
    event = data["event"]
    what = data.get("job") or (data.get("incident") or {}).get("subject") or ""
    prefix = {"reminder": "Reminder: ", "resolved": "Resolved: "}.get(data.get("phase", ""), "")
    if event == "job.recovered":
        prefix = ""
    words = TITLES.get(event, event)
    about = f" {what}" if what else ""
    return f"[{data['team']}] {prefix}{event}{about}: {words}"


def slack(data: dict[str, Any]) -> bytes:
    """A Slack-compatible incoming webhook body (`text`, mrkdwn). The summary quotes a
    worker's error message: escaped, its `<!channel>` or `<url|label>` stays text."""
    text = f"*{_escaped(title(data))}*\n{_escaped(data['summary'])}"
    return orjson.dumps({"text": f"{text}\n<{data['url']}|Open in cronlease>"})


def _escaped(text: str) -> str:
    """Text as Slack's mrkdwn shows it literally: its three control characters escaped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def email(data: dict[str, Any]) -> tuple[str, str]:
    """The subject and plain-text body of an email."""
    lines = [data["summary"], "", data["url"], ""]
    lines += [f"event: {data['event']} ({data.get('phase', '')})", f"team: {data['team']}"]
    if data.get("job"):
        lines.append(f"job: {data['job']}")
    if data.get("runId"):
        lines.append(f"run: {data['runId']}")
    lines.append(f"at: {data['at']}")
    return f"[cronlease] {title(data)}", "\n".join(lines) + "\n"


def age(delta) -> str:
    """A duration in words people page with: "45 s", "12 min", "3 h 5 min", "2 d 4 h"."""
    seconds = max(0, int(delta.total_seconds()))
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"
