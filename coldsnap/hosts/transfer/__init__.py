"""File transfer to and from a host: verified end to end (sha256 on both sides), resumable.

Where things live:
  driver.py          the entry points, `put_file` and `fetch_file` (what `SSHHost.put` and
                     `.get` call): choose the data path, retry with resume
  protocol.py        what both data paths share: the far side's argv, how its exit status is
                     read, the resume handshake's offset decision, `remote_digests`
  over_asyncssh.py   put and get over one exec stream of the pooled asyncssh connection
  openssh_put.py     put through the system's OpenSSH client (the bulk bytes)
  openssh_get.py     get through the system's OpenSSH client
  openssh_client.py  that client: its argv (pinned to the inventory's trust) and the thread it
                     runs in
  streams.py         an open exec channel, and the narrow host interface transfers need

The far side of every transfer is the host-side helper program (`coldsnap.hosts.helper`).
"""
