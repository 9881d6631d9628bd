from django.db import migrations, models


def encrypt_webhook_secrets(apps, schema_editor):
    """The keys stored in plain text, encrypted as the new column keeps them."""
    from sigil.encryption import secret_encrypt

    Agent = apps.get_model("agents", "Agent")
    for agent in Agent.objects.exclude(webhook_secret=""):
        agent.webhook_secret_encrypted = secret_encrypt(agent.webhook_secret)
        agent.save(update_fields=["webhook_secret_encrypted"])


def decrypt_webhook_secrets(apps, schema_editor):
    from sigil.encryption import secret_decrypt

    Agent = apps.get_model("agents", "Agent")
    for agent in Agent.objects.exclude(webhook_secret_encrypted=""):
        agent.webhook_secret = secret_decrypt(agent.webhook_secret_encrypted)
        agent.save(update_fields=["webhook_secret"])


class Migration(migrations.Migration):
    dependencies = [
        ("agents", "0002_lifecycle"),
    ]

    operations = [
        migrations.AddField(
            model_name="agent",
            name="webhook_secret_encrypted",
            field=models.TextField(blank=True, editable=False),
        ),
        migrations.RunPython(encrypt_webhook_secrets, decrypt_webhook_secrets),
        migrations.RemoveField(model_name="agent", name="webhook_secret"),
    ]
