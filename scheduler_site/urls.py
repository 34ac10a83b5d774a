from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("apps.api.urls")),
    path("admin/", admin.site.urls),
]

handler404 = "apps.api.errors.not_found"
handler500 = "apps.api.errors.server_error"
