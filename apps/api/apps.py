from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "apps.api"
    label = "api"

    def ready(self) -> None:
        # Registers the OpenAPI extensions (bearer auth, strict request bodies) with drf-spectacular.
        from apps.api import schema  # noqa: F401
