from __future__ import annotations

from django.urls import path

from apps.dashboard.consumers import LiveConsumer

websocket_urlpatterns = [path("ws/live/", LiveConsumer.as_asgi())]
