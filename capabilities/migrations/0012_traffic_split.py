"""Staged versions and traffic splits: the staged version, the split's weight, caller key and
guard on a capability, and the placement of a staged version in traffic as a capability of
its own (`variant_of`), whose `{full}--v{n}` name needs longer full names."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("capabilities", "0011_refusals_counted"),
    ]

    operations = [
        migrations.AddField(
            model_name="capability",
            name="split_caller_header",
            field=models.CharField(
                blank=True,
                help_text="The header whose value keeps a caller on one version; empty: its token.",
                max_length=100,
            ),
        ),
        migrations.AddField(
            model_name="capability",
            name="split_guard_margin",
            field=models.FloatField(
                blank=True,
                help_text="Abort the split when the staged version's error rate exceeds the current one's by this much.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="capability",
            name="split_guard_min_calls",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="capability",
            name="split_started_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="capability",
            name="split_weight",
            field=models.PositiveSmallIntegerField(
                blank=True,
                help_text="Percent of callers sent to the staged version; empty when no split runs.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="capability",
            name="staged_version",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="capabilities.capabilityversion",
            ),
        ),
        migrations.AddField(
            model_name="capability",
            name="variant_of",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="variants",
                to="capabilities.capability",
            ),
        ),
        migrations.AlterField(
            model_name="capability",
            name="full_name",
            field=models.CharField(db_index=True, max_length=90),
        ),
        migrations.AlterField(
            model_name="capabilitystatswindow",
            name="full_name",
            field=models.CharField(max_length=90),
        ),
    ]
