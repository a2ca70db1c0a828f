"""Transport to destination hosts (SSH or local) and the facts probed from them.

Layers above speak only to the `Host` protocol (base.py); nothing is installed on a host.

  base.py        the `Host` protocol, its errors and results
  inventory.py   which hosts exist and how to reach them (YAML)
  settings.py    the transport's knobs (timeouts, channels, ciphers, bulk transport)
  pool.py        `HostPool`: one long-lived SSH connection per host, shared limits
  ssh.py         `SSHHost`: the protocol over asyncssh (commands, streams, forwards)
  host_keys.py   host key trust: the inventory's known_hosts only
  local.py       `LocalHost`: the protocol on the control node itself (tests)
  retry.py       the one rule of what is worth another try, and every retry loop's policy
  transfer/      put and get of files, verified end to end and resumable
  helper/        the host-side helper program: the far side of transfers, CRIU image sets,
                 what a host holds (sent with each call, Python's standard library only)
  durable.py     the control node's atomic write (fsync, rename, fsync of the directory)
  probe.py       a host's facts (arch, kernel, Docker, NVIDIA driver and GPUs, free space)
  ports.py       which TCP ports a host already listens on
  http.py        HTTP requests sent from a host to a service on its network
"""
