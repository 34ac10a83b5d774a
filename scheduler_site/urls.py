from django.contrib import admin
from django.urls import include, path

from apps.dashboard.views.signin import AdminSignInForm, admin_sign_in

admin.site.login_form = AdminSignInForm

urlpatterns = [
    path("", include("apps.api.urls")),
    # The admin's sign-in says when a lockout refused it, as the dashboard's does.
    path("admin/login/", admin_sign_in),
    path("admin/", admin.site.urls),
    # The dashboard last: its addresses (`/`, `/runs`, `/jobs/<name>`) are the people-facing rest.
    path("", include("apps.dashboard.urls")),
]

# JSON problem details under /api/, HTML pages everywhere else.
handler400 = "apps.dashboard.errors.bad_request"
handler404 = "apps.dashboard.errors.not_found"
handler500 = "apps.dashboard.errors.server_error"
