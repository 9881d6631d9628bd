"""Bindings were offered to every agent before grants: grant each agent exactly the bindings
its current capabilities declare, so that they keep working and nothing more is opened."""

from django.db import migrations


def grant_declared(apps, schema_editor):
    Binding = apps.get_model("capabilities", "Binding")
    BindingGrant = apps.get_model("capabilities", "BindingGrant")
    Capability = apps.get_model("capabilities", "Capability")
    configured = {f"{b.kind}:{b.name}": b.pk for b in Binding.objects.all()}
    wanted = set()
    # Filtered in Python rather than with a JSON lookup, which SQLite does not have.
    for agent_id, declared in Capability.objects.exclude(state="removed").values_list("agent_id", "bindings"):
        wanted.update((configured[d], agent_id) for d in declared or [] if d in configured)
    BindingGrant.objects.bulk_create(
        [BindingGrant(binding_id=binding_id, agent_id=agent_id) for binding_id, agent_id in sorted(wanted)],
        ignore_conflicts=True,
    )


class Migration(migrations.Migration):
    dependencies = [("capabilities", "0008_binding_grant")]

    operations = [migrations.RunPython(grant_declared, migrations.RunPython.noop)]
