"""Template helpers: times in UTC with their age, state badges, JSON, diffs, role checks."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django import template
from django.utils import timezone
from django.utils.html import conditional_escape, format_html
from django.utils.safestring import SafeData, mark_safe

from apps.jobs import schedule as sched
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import PRIORITY_NAMES
from apps.teams import access

register = template.Library()


def _age(delta: timedelta) -> str:
    seconds = int(abs(delta.total_seconds()))
    if seconds < 60:
        text = f"{seconds} s"
    elif seconds < 3600:
        text = f"{seconds // 60} min"
    elif seconds < 86400:
        text = f"{seconds // 3600} h {seconds % 3600 // 60} min"
    else:
        text = f"{seconds // 86400} d {seconds % 86400 // 3600} h"
    return f"in {text}" if delta.total_seconds() < 0 else f"{text} ago"


@register.filter
def utc(value: datetime | None) -> str:
    """2026-03-15 02:00:03 UTC."""
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# An instant as `format_utc` writes it into words built on the server (a run's reasons, an
# alert's message, a flash message).
INSTANT = re.compile(r"\b\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?Z")


@register.filter
def instants(text: Any) -> str:
    """Words built on the server with each instant they name as a `<time>`, which the page's
    script writes in the reader's zone as it writes every other time (they read UTC where the
    rest of the page read local time). Text already made HTML is left as it is."""
    if isinstance(text, SafeData):
        return text
    return mark_safe(INSTANT.sub(_time_element, str(conditional_escape(text))))


def _time_element(match: re.Match[str]) -> str:
    try:
        at = datetime.fromisoformat(match.group(0))
    except ValueError:  # the shape of an instant, not one (a 25th hour)
        return match.group(0)
    return format_html(
        '<time datetime="{}" title="{}" data-when="long">{}</time>',
        format_utc(at), format_utc(at), utc(at),
    )  # fmt: skip


@register.filter
def iso(value: datetime | None) -> str:
    if value is None:
        return ""
    return format_utc(value)


@register.simple_tag(takes_context=True)
def when(context: template.Context, value: datetime | None, short: bool = False) -> str:
    """A time with its relative age ("3 min ago", "in 2 h"): rendered in UTC, then shown by
    the dashboard's script in the reader's local time with its zone (the ISO instant on hover)
    and its age kept current (static/dashboard/dashboard.js, `data-when`)."""
    if value is None:
        return mark_safe('<span class="muted">—</span>')
    now = context.get("now") or timezone.now()
    stamp = value.astimezone(UTC)
    shown = stamp.strftime("%H:%M:%S UTC" if short else "%Y-%m-%d %H:%M:%S UTC")
    return format_html(
        '<time datetime="{}" title="{}" data-when="{}">{}</time> <span class="age">{}</span>',
        iso(stamp),
        iso(stamp),
        "short" if short else "long",
        shown,
        _age(now - stamp),
    )


@register.filter
def age(value: datetime | None, now: datetime | None = None) -> str:
    if value is None:
        return "—"
    return _age((now or timezone.now()) - value)


@register.filter
def seconds(value: float | None) -> str:
    """A duration in seconds, readable: 42 ms, 1.3 s, 2 min 5 s."""
    if value is None:
        return "—"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.1f} s"
    if value < 3600:
        return f"{int(value // 60)} min {int(value % 60)} s"
    return f"{int(value // 3600)} h {int(value % 3600 // 60)} min"


@register.filter
def state_badge(state: str) -> str:
    return format_html('<span class="state state-{}">{}</span>', state, state.replace("_", " "))


@register.filter
def priority_name(value: int) -> str:
    return PRIORITY_NAMES.get(value, str(value))


@register.filter
def run_id(pk: int) -> str:
    return public_run_id(pk)


@register.filter
def pretty_json(value: Any) -> str:
    """Indented JSON as plain text; the template escapes it like any other string."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


@register.filter
def compact_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


@register.filter
def overlap_policy(value: str | None) -> str:
    """A schedule's overlapPolicy in words ("skip — no new run while one is waiting or running");
    a schedule stored without one has the default."""
    policy = value or sched.DEFAULT_OVERLAP_POLICY
    words = sched.OVERLAP_POLICIES.get(policy)
    return f"{policy} — {words}" if words else policy


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix or "value": value}


@register.filter
def audit_diff(event: Any) -> list[dict[str, Any]]:
    """The fields an audit event changed: [{"field", "before", "after", "kind"}], by field."""
    before = _flatten(event.before) if event.before is not None else {}
    after = _flatten(event.after) if event.after is not None else {}
    rows = []
    for field in sorted(set(before) | set(after)):
        old, new = before.get(field, None), after.get(field, None)
        if field in before and field in after and old == new:
            continue
        kind = "added" if field not in before else "removed" if field not in after else "changed"
        rows.append(
            {
                "field": field,
                "before": compact_json(old) if field in before else "",
                "after": compact_json(new) if field in after else "",
                "kind": kind,
            }
        )
    return rows


@register.simple_tag(takes_context=True)
def allowed(context: template.Context, role: str, team: Any) -> bool:
    """`{% allowed "operator" run.team_id as can_operate %}`: the same check the views make."""
    request = context.get("request")
    if request is None or team is None:
        return False
    return access.has_role(request.user, team, role)


@register.simple_tag(takes_context=True)
def query(context: template.Context, **changes: Any) -> str:
    """The current query string with some parameters replaced (None drops one)."""
    params = context["request"].GET.copy()
    for key, value in changes.items():
        if value is None or value == "":
            params.pop(key, None)
        else:
            params[key] = value
    encoded = params.urlencode()
    return f"?{encoded}" if encoded else "?"


@register.filter
def get_item(mapping: Any, key: str) -> Any:
    if not mapping:
        return ""
    return mapping.get(key, "")


WEB_SCHEMES = frozenset({"http", "https"})


@register.filter
def runbook_link(url: str | None, text: str = "") -> str:
    """A runbook as a link that opens apart from the dashboard; only http(s) URLs become links
    (anything else, `javascript:` included, is shown as plain text)."""
    if not url:
        return mark_safe('<span class="muted">—</span>')
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if parts is None or parts.scheme.lower() not in WEB_SCHEMES or not parts.netloc:
        return format_html('<span class="mono" title="Not a web address">{}</span>', url)
    return format_html(
        '<a class="runbook" href="{}" target="_blank" rel="noopener noreferrer" title="{}">{}</a>',
        url,
        url,
        text or url,
    )
