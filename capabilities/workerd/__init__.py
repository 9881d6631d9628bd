"""workerd on this machine: the part the local runtime and the Cloudflare emulator share.

- `config`: the capnp config of a workerd serving the loader host.
- `host`: one workerd process (`WorkerdHost`): start, stop, its output, simple supervision.
- `supervision`: one process under a liveness probe and a CPU-stall and memory watchdog
  (`SupervisedWorkerd`), and the record of why it was stopped (`Kill`, `KillLog`).
- `group`: a supervised process per name, on a port each every process agrees on
  (`WorkerdGroup`, `PortRegistry`), and the status file (`read_status`).

When a process that ended is started again is sigil.restarts' rule, shared with runsigil.
"""
