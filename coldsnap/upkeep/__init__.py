"""Upkeep: what keeps the hosts, the store and the registry clean between and after
operations, for `coldsnapd gc` and the service alike. It sits above the runner (which runs
one operation and never imports it) and below both front ends.

- `orphans`: the judge that tells an orphaned container or directory from one meant to be
  there, and its per-host step.
- `reclaim`: a dead operation reclaimed (its orphans removed, what it stopped brought back by
  `repair`, its record `interrupted`); `coldsnapd gc` and the service's crash recovery both
  call it.
- `unreferenced`: what no artifact references, in the store, on the hosts (their Docker's
  capsule images: `docker_images`) and in the registry (`registry_sweep`).
- `temp_files`: partial files on the hosts that outlived their run.
- `cache_budgets`: when caches are held to their budgets and what the ledger protects;
  `host_budgets`: a host's data_dir against its budget.
"""
