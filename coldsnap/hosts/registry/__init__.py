"""OCI registries as the distributed store of artifacts: how the control node and the hosts
reach one (`access`), the control node's client (`client`), and the host-side blob transfers
(`blobs`: each host pushes and pulls its own objects, by digest)."""
