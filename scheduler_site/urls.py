from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("apps.api.urls")),
    path("admin/", admin.site.urls),
    # The dashboard last: its addresses (`/`, `/runs`, `/jobs/<name>`) are the people-facing rest.
    path("", include("apps.dashboard.urls")),
]

# JSON problem details under /api/, HTML pages everywhere else.
handler404 = "apps.dashboard.errors.not_found"
handler500 = "apps.dashboard.errors.server_error"
