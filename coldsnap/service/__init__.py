"""`coldsnapd serve`: the control node's service (job store, socket API, systemd, metrics)
and the CLI's client of it. The top of the import direction, with the CLI."""
