from django.apps import AppConfig


class NotifyConfig(AppConfig):
    name = "apps.notify"
    label = "notify"
