"""The operation runner: what the CLI and the service share, below both.

One operation, whichever front end asks for it, goes through the same steps here:
- `operation_kinds`, `lifecycle_kinds`: each operation's `prepare`, from typed `RunOptions` and the
  request to a `Prepared` operation (its body, receipt key, what it touches), before any host
  is touched; bad input raises `Refused`.
- `claim`: the operation id claimed in the operation's ledger (`ledger`), after the front
  end's own outputs were checked; a retry of a request that already succeeded raises
  `AlreadyDone` with that run's receipt.
- `execute`: the body on a pool of host connections, within its deadline (`deadline`),
  cancellable by signal (`signals`) or by the service; `conclude` ends it in exactly one
  receipt and an exit status (`Outcome`).

What a dead operation left, and the caches' budgets, are upkeep's (coldsnap.upkeep), a layer
above: `execute` runs the cache budgets through the `after` its front end passes it.

The runner prints nothing: an operation's lines go to the `Report` its front end gives it
(the CLI's stderr and stdout, or a service job's stream), and outcomes come back as values.
"""
