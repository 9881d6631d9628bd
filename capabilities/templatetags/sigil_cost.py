"""`{% cost_section %}`: the owner's cost estimate as a small block of the dashboard, kept in
its own template so that the dashboard's page needs only the one tag."""

from django import template
from django.utils import timezone

from capabilities import cost

register = template.Library()


@register.inclusion_tag("admin/sigil/cost_section.html")
def cost_section() -> dict:
    return {"estimate": cost.cost_estimate(now=timezone.now())}
