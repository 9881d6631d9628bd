"""`python manage.py cost [--days N] [--json]`: the monthly cost estimate per runtime, as
`GET /_api/cost` answers it (capabilities/cost.py)."""

import json

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from capabilities import cost


class Command(BaseCommand):
    help = (
        "Estimate what the recorded traffic of the last days would cost a month on each Cloudflare runtime, "
        "and how many worker-pool slots would have kept cold calls under 1 %."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--days", type=float, default=cost.DAYS_PER_MONTH, help="the window, in days (30)")
        parser.add_argument("--json", action="store_true", help="print the estimate as JSON, as GET /_api/cost")

    def handle(self, *args, **options) -> None:
        days = options["days"]
        if not 0 < days <= settings.SIGIL_STATS_RETENTION_DAYS:
            raise CommandError(f"--days must be over 0 and at most {settings.SIGIL_STATS_RETENTION_DAYS}")
        estimate = cost.cost_estimate(now=timezone.now(), days=days)
        if options["json"]:
            self.stdout.write(json.dumps(estimate.as_json(), indent=2))
            return
        usage, pool = estimate.usage, estimate.pool
        self.stdout.write(f"Traffic of the last {days:g} days, as a month: {usage.calls:,.0f} calls")
        for bill in estimate.runtimes:
            fits = "" if bill.fits else f"  (does not fit: {'; '.join(bill.limits)})"
            self.stdout.write(f"  {bill.plan:<32} {bill.runtime:<12} ${bill.monthly_usd:>10.2f}{fits}")
        cold = "–" if pool.cold_share is None else f"{pool.cold_share:.2%}"
        self.stdout.write(
            f"Pool: {pool.page_ins_per_hour:g} page-ins an hour (peak {pool.peak_page_ins_per_hour}), "
            f"{pool.cloudflare_api_calls_per_hour:g} Cloudflare API calls an hour (peak "
            f"{pool.peak_cloudflare_api_calls_per_hour}) of a budget of {pool.cloudflare_api_budget_per_hour:g}; "
            f"cold calls {cold}; fewest slots for under 1 % cold: {pool.smallest_slots_under_1pct or '–'} "
            f"(replaying {pool.replayed_calls} calls)"
        )
        for what, counts in (
            ("class of work", pool.cloudflare_api_calls_by_class),
            ("operation", pool.cloudflare_api_calls_by_operation),
        ):
            if counts:
                spent = ", ".join(f"{name} {count}" for name, count in counts.items())
                self.stdout.write(f"Cloudflare API calls by {what}: {spent}")
