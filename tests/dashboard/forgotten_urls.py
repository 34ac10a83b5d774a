"""The site's URLs plus a page whose view forgot to ask for a signed-in user."""

from django.http import HttpResponse
from django.urls import path

from scheduler_site.urls import urlpatterns as site

urlpatterns = [path("forgotten", lambda request: HttpResponse("secret")), *site]
