from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.api import views_channels as channels
from apps.api import views_health as health
from apps.api import views_manage as manage
from apps.api import views_ops as ops
from apps.api import views_worker as worker
from apps.api import views_workers as workers

urlpatterns = [
    # Worker protocol
    path("api/v1/leases", worker.LeasesView.as_view(), name="api-leases"),
    path("api/v1/heartbeats", worker.BatchHeartbeatsView.as_view(), name="api-heartbeats"),
    path("api/v1/results", worker.BatchResultsView.as_view(), name="api-results"),
    path(
        "api/v1/runs/<str:run_id>/heartbeat",
        worker.HeartbeatView.as_view(),
        name="api-run-heartbeat",
    ),
    path(
        "api/v1/runs/<str:run_id>/complete", worker.CompleteView.as_view(), name="api-run-complete"
    ),
    path("api/v1/runs/<str:run_id>/fail", worker.FailView.as_view(), name="api-run-fail"),
    # Management
    path("api/v1/jobs", manage.JobsView.as_view(), name="api-jobs"),
    path("api/v1/jobs/<str:name>", manage.JobDetailView.as_view(), name="api-job"),
    path("api/v1/jobs/<str:name>/pause", manage.JobPauseView.as_view(), name="api-job-pause"),
    path("api/v1/jobs/<str:name>/resume", manage.JobResumeView.as_view(), name="api-job-resume"),
    path("api/v1/jobs/<str:name>/trigger", manage.JobTriggerView.as_view(), name="api-job-trigger"),
    path("api/v1/jobs/<str:name>/preview", manage.JobPreviewView.as_view(), name="api-job-preview"),
    path("api/v1/jobs/<str:name>/runs", manage.JobRunsView.as_view(), name="api-job-runs"),
    path("api/v1/preview", manage.PreviewView.as_view(), name="api-preview"),
    path("api/v1/runs", manage.RunsView.as_view(), name="api-runs"),
    path("api/v1/runs/<str:run_id>", manage.RunDetailView.as_view(), name="api-run"),
    path("api/v1/runs/<str:run_id>/cancel", manage.RunCancelView.as_view(), name="api-run-cancel"),
    path("api/v1/runs/<str:run_id>/retry", manage.RunRetryView.as_view(), name="api-run-retry"),
    path("api/v1/dlq", manage.DlqView.as_view(), name="api-dlq"),
    path("api/v1/dlq/requeue", manage.DlqActionView.as_view(), name="api-dlq-requeue"),
    path("api/v1/dlq/discard", manage.DlqDiscardView.as_view(), name="api-dlq-discard"),
    # Operations
    path("api/v1/runs/<str:run_id>/why", ops.RunWhyView.as_view(), name="api-run-why"),
    path("api/v1/jobs/<str:name>/why", ops.JobWhyView.as_view(), name="api-job-why"),
    path("api/v1/jobs/<str:name>/backfill", ops.JobBackfillView.as_view(), name="api-job-backfill"),
    path("api/v1/queues", ops.QueuesView.as_view(), name="api-queues"),
    path("api/v1/alerts", ops.AlertsView.as_view(), name="api-alerts"),
    path("api/v1/queues/<str:name>", ops.QueueSettingsView.as_view(), name="api-queue"),
    path("api/v1/queues/<str:name>/pause", ops.QueuePauseView.as_view(), name="api-queue-pause"),
    path("api/v1/queues/<str:name>/resume", ops.QueueResumeView.as_view(), name="api-queue-resume"),
    path("api/v1/workers", workers.WorkersView.as_view(), name="api-workers"),
    # Notifications
    path("api/v1/channels", channels.ChannelsView.as_view(), name="api-channels"),
    path(
        "api/v1/channels/<str:channel_id>",
        channels.ChannelDetailView.as_view(),
        name="api-channel",
    ),
    path(
        "api/v1/channels/<str:channel_id>/test",
        channels.ChannelTestView.as_view(),
        name="api-channel-test",
    ),
    path(
        "api/v1/channels/<str:channel_id>/deliveries",
        channels.ChannelDeliveriesView.as_view(),
        name="api-channel-deliveries",
    ),
    # Schema and health
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", health.metrics, name="metrics"),
]


# The API authenticates bearer tokens itself: the dashboard's sign-in gate does not apply.
for pattern in urlpatterns:
    pattern.callback.login_required = False
