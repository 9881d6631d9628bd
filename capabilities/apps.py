from django.apps import AppConfig


class CapabilitiesConfig(AppConfig):
    name = "capabilities"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from capabilities import checks  # noqa: F401  (registers the system checks)
