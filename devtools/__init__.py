"""Development tooling of coldsnapd (not shipped with the `coldsnap` package).

`devtools.cluster` is the local dev cluster behind `scripts/dev-cluster`: simulated hosts, each
with its own network namespace, sshd and (optionally) dockerd, joined by one bridge on
198.18.0.0/24. `devtools.session` lets other scripts (the benchmarks) start it when it is not up.
Standard library only, so any Python 3.11 can run it.
"""
