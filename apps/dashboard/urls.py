"""Bookmarkable addresses (README, "Dashboard"): filters travel in the query string."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from apps.dashboard.views import (
    alerts,
    audit,
    channels,
    jobs,
    overview,
    queues,
    runs,
    signin,
    teams,
    workers,
)

app_name = "dashboard"

urlpatterns = [
    path("accounts/login/", signin.SignInView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", overview.overview, name="overview"),
    path("failures", runs.failures, name="failures"),
    path("runs", runs.runs, name="runs"),
    path("runs/bulk", runs.bulk, name="bulk"),
    path("runs/matching", runs.bulk_matching, name="bulk-matching"),
    path("runs/<str:run_id>", runs.run_detail, name="run"),
    path("runs/<str:run_id>/<str:action>", runs.run_action, name="run-action"),
    path("dlq", runs.dlq, name="dlq"),
    path("jobs", jobs.jobs, name="jobs"),
    path("jobs/new", jobs.job_new, name="job-new"),
    # Job names start with a letter or digit, so "-" cannot collide with one.
    path("jobs/-/preview", jobs.job_preview, name="job-preview"),
    path("jobs/-/check", jobs.job_check, name="job-check"),
    path("jobs/<str:name>", jobs.job_detail, name="job"),
    path("jobs/<str:name>/edit", jobs.job_edit, name="job-edit"),
    path("jobs/<str:name>/pause", jobs.job_pause, {"paused": True}, name="job-pause"),
    path("jobs/<str:name>/resume", jobs.job_pause, {"paused": False}, name="job-resume"),
    path("jobs/<str:name>/trigger", jobs.job_trigger, name="job-trigger"),
    path("jobs/<str:name>/dry-run", jobs.job_dry_run, name="job-dry-run"),
    path("jobs/<str:name>/delete", jobs.job_delete, name="job-delete"),
    path("jobs/<str:name>/backfill", jobs.job_backfill, name="job-backfill"),
    path("alerts", alerts.alerts, name="alerts"),
    path("queues", queues.queues, name="queues"),
    path(
        "queues/<slug:team>/<str:queue>/pause",
        queues.queue_pause,
        {"paused": True},
        name="queue-pause",
    ),
    path(
        "queues/<slug:team>/<str:queue>/resume",
        queues.queue_pause,
        {"paused": False},
        name="queue-resume",
    ),
    path("workers", workers.workers, name="workers"),
    path("audit", audit.audit, name="audit"),
    path("teams", teams.teams, name="teams"),
    path("teams/<slug:slug>", teams.team_detail, name="team"),
    path("teams/<slug:slug>/members", teams.member_set, name="member-set"),
    path(
        "teams/<slug:slug>/members/<int:member_id>/remove",
        teams.member_remove,
        name="member-remove",
    ),
    path("teams/<slug:slug>/tokens", teams.token_create, name="token-create"),
    path(
        "teams/<slug:slug>/tokens/<int:token_id>/revoke",
        teams.token_revoke,
        name="token-revoke",
    ),
    path("teams/<slug:slug>/channels", channels.channel_create, name="channel-create"),
    path("teams/<slug:slug>/channels/<int:channel_id>", channels.channel_detail, name="channel"),
    path(
        "teams/<slug:slug>/channels/<int:channel_id>/test",
        channels.channel_test,
        name="channel-test",
    ),
    path(
        "teams/<slug:slug>/channels/<int:channel_id>/enable",
        channels.channel_enable,
        name="channel-enable",
    ),
    path(
        "teams/<slug:slug>/channels/<int:channel_id>/delete",
        channels.channel_delete,
        name="channel-delete",
    ),
]
