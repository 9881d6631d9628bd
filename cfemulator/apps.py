from django.apps import AppConfig


class CfemulatorConfig(AppConfig):
    name = "cfemulator"
    verbose_name = "Cloudflare emulator"
