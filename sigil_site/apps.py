from django.apps import AppConfig


class SigilSiteConfig(AppConfig):
    name = "sigil_site"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_in

        user_logged_in.connect(_forget_first_password, dispatch_uid="sigil_site.owner_password_forget")


def _forget_first_password(sender, user, **kwargs) -> None:
    """A superuser signed in: the owner's first password, kept for runsigil's banner, is not shown again."""
    if user.is_superuser:
        from django.conf import settings

        from sigil_site.owner import owner_password_forget

        owner_password_forget(var_dir=settings.VAR_DIR)
