"""`python manage.py switchbackend [--from BACKEND] [--dry-run [--json]]`: move every capability to the runtime
the running Sigil serves (SIGIL_BACKEND), showing progress. Run it after restarting Sigil with the new
SIGIL_BACKEND, from any shell; run it again if it was interrupted."""

import json
import os
import sys

from django.conf import settings
from django.core.management.base import CommandError

from capabilities.names import placement_label
from capabilities.runtimes import RUNTIMES
from capabilities.runtimes.errors import RuntimeFailure
from capabilities.services import SwitchEvent, SwitchPlan, backend_switch, switch_plan, switch_target
from sigil.errors import SigilError
from sigil.owner_commands import CLI_ACTOR, SigilCommand, argument
from sigil.serving import serving_now, switch_command


class Command(SigilCommand):
    """Move every capability placed on another runtime to the one the running Sigil serves (its SIGIL_BACKEND,
    which a shell that sets SIGIL_BACKEND must name too): place it there, record it, then delete the old
    placement after a grace period. Agents keep their URLs and tokens throughout. Resumable: run it again
    after an interruption."""

    arguments = (
        argument(
            "--from",
            dest="source",
            choices=list(RUNTIMES),
            help="move only capabilities on this runtime; also the runtime of capabilities placed before "
            "Sigil recorded runtimes",
        ),
        argument("--dry-run", action="store_true", help="only list what would move; change nothing, call no runtime"),
        argument("--json", action="store_true", dest="as_json", help="with --dry-run: print the list as JSON"),
    )

    def handle(self, *args, source: str | None = None, dry_run: bool = False, as_json: bool = False, **options) -> None:
        if as_json and not dry_run:
            raise CommandError("--json goes with --dry-run")
        self._on_the_runtime_sigil_serves()
        if dry_run:
            try:
                plan = switch_plan(source=source)
            except SigilError as exc:
                raise CommandError(str(exc)) from exc
            self._show_plan(plan, as_json=as_json)
            return
        target = settings.SIGIL_BACKEND
        counts = {"moved": 0, "reassigned": 0, "already": 0, "gone": 0, "skipped": 0, "failed": 0}
        try:
            for event in backend_switch(
                source=source, actor=CLI_ACTOR, grace_seconds=settings.SIGIL_SWITCH_GRACE_SECONDS
            ):
                self._show(event, target, counts)
        except (SigilError, RuntimeFailure) as exc:
            raise CommandError(str(exc)) from exc
        summary = ", ".join(f"{count} {what}" for what, count in counts.items() if count)
        self.stdout.write(f"Switched to {target}: {summary or 'nothing to move'}.")
        if counts["failed"]:
            raise CommandError(f"{counts['failed']} could not be switched; they are still served where they were")

    def _on_the_runtime_sigil_serves(self) -> None:
        """Go on with the settings of the runtime the running Sigil serves: this process's when
        they name it; otherwise this command again, as a new program (same pid) whose settings
        are that runtime's, as the running Sigil's are (what settings derive from SIGIL_BACKEND
        included). Refuses, naming the command to run, when the runtime cannot be told."""
        try:
            target = switch_target(
                configured=settings.SIGIL_BACKEND,
                named_here="SIGIL_BACKEND" in os.environ,
                serving=serving_now(settings.VAR_DIR),
                var_dir=settings.VAR_DIR,
            )
        except SigilError as exc:
            raise CommandError(exc.message) from exc
        if target == settings.SIGIL_BACKEND:
            return
        if sys.argv[1:2] != ["switchbackend"]:  # called from Python: no program of its own to start again
            raise CommandError(f"Sigil serves {target}, not {settings.SIGIL_BACKEND}: run `{switch_command(target)}`")
        self.stderr.write(f"Sigil serves {target} (SIGIL_BACKEND is not set here): switching to {target}")
        self.stderr.flush()
        self.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "SIGIL_BACKEND": target})

    def _show_plan(self, plan: SwitchPlan, *, as_json: bool) -> None:
        moving = [{"capability": full, "from": backend} for full, backend in plan.moving]
        if as_json:
            document = {"to": plan.target, "unrecorded": plan.unrecorded, "moving": moving, "skipped": plan.skipped}
            self.stdout.write(json.dumps(document))
            return
        for item in moving:
            self.stdout.write(f"{placement_label(item['capability'])}: {item['from']} -> {plan.target}")
        for full in plan.skipped:
            self.stdout.write(f"{placement_label(full)}: never placed, stays on no runtime")
        self.stdout.write(f"Would switch {len(moving)} capabilities to {plan.target}; nothing was changed.")

    def _show(self, event: SwitchEvent, target: str, counts: dict[str, int]) -> None:
        if event.kind == "provisioned":
            for line in event.lines:
                self.stdout.write(line)
        elif event.kind == "adopted":
            self.stdout.write(f"{event.total} capabilities placed before runtimes were recorded are on {event.backend}")
        elif event.kind == "skipped":
            counts["skipped"] += 1
            self.stdout.write(f"{event.full}: never placed, nothing to move (it stays on no runtime)")
        elif event.kind == "moved":
            step = event.step
            counts[step.outcome] += 1
            where = {
                "moved": f"{step.source} {step.old_slot} -> {target} {step.new_slot}",
                "reassigned": f"{step.source} {step.old_slot} -> {target} (pages in on its next call)",
                "already": f"already on {target}",
                "gone": "removed meanwhile",
            }[step.outcome]
            self.stdout.write(f"[{event.index}/{event.total}] {placement_label(event.full)}: {where}")
        elif event.kind == "failed" and event.slots:
            self.stderr.write(f"  could not delete {event.slots[0]} from {event.backend} yet: {event.error}")
        elif event.kind == "failed":
            counts["failed"] += 1
            self.stderr.write(f"[{event.index}/{event.total}] {placement_label(event.full)}: {event.error}")
        elif event.kind == "released" and event.slots:
            self.stdout.write(f"  deleted {event.slots[0]} from {event.backend} ({placement_label(event.full)})")
        elif event.kind == "swept" and event.slots:
            leftovers = ", ".join(event.slots)
            self.stdout.write(f"deleted {len(event.slots)} leftover placements from {event.backend}: {leftovers}")
