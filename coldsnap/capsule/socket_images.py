"""The inet sockets of a CRIU image set, read and re-addressed at the byte level.

A unit restored onto another host keeps its TCP connections only if every socket entry of
every unit of the workload names the new addresses: CRIU binds each restored socket to its
`src_addr` and repairs it towards its `dst_addr` (`FileEntry.isk`, fields 11 and 12: repeated
uint32 words holding the address's bytes in network order, one word for IPv4, four for IPv6).
The whole workload's map is applied to both ends of every socket, since a unit knowing only
its own mapping cannot restore its peers' ends. Loopback, unspecified and unmapped addresses
are left as they are: they mean the same on every host.

Neither crit nor pycriu exists in the capsules, so the protobuf is read and written here by
hand: an entry that no mapping touches is copied as it was, so an identity map returns the
image byte for byte. Stdlib only: this file is also the program run inside the capsule with the
capsule's python3 (`PROGRAM`, see `main`)."""

from __future__ import annotations

import ipaddress
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

FILES_IMG = "files.img"
# Every CRIU image but the inventory opens with this word, then the image's own magic.
_COMMON_MAGIC = 0x54564319
_HEADER = 8
# FileEntry.isk, and the InetSkEntry fields read here.
_FILE_ISK = 4
_F_FAMILY, _F_PROTO, _F_STATE, _F_SPORT, _F_DPORT, _F_SRC, _F_DST = 3, 5, 6, 7, 8, 11, 12
_AF_INET, _AF_INET6 = 2, 10
_PROTOS = {6: "tcp", 17: "udp", 132: "sctp", 136: "udplite", 0: "ip", 255: "raw"}
# The kernel's TCP states (include/net/tcp_states.h).
TCP_STATES = {1: "established", 2: "syn_sent", 3: "syn_recv", 4: "fin_wait1",
              5: "fin_wait2", 6: "time_wait", 7: "close", 8: "close_wait", 9: "last_ack",
              10: "listen", 11: "closing", 12: "new_syn_recv"}
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclass(frozen=True)
class InetSocket:
    """One inet socket: its local end (src, sport) and its peer (dst, dport)."""

    family: int  # 4 or 6
    proto: str
    state: str
    src: str
    sport: int
    dst: str
    dport: int


# ---- the protobuf wire format, by hand ------------------------------------------------------

def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


@dataclass(frozen=True)
class _Field:
    number: int
    wire: int
    value: int  # a varint's or a fixed field's value; a length-delimited field's start
    start: int  # the field's first byte (its key) in the message
    end: int  # one past its last byte
    payload: tuple[int, int] = (0, 0)  # a length-delimited field's bytes


def _fields(buf: bytes, start: int, end: int) -> list[_Field]:
    out: list[_Field] = []
    pos = start
    while pos < end:
        first = pos
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == _VARINT:
            value, pos = _varint(buf, pos, end)
            out.append(_Field(number, wire, value, first, pos))
        elif wire in (_I64, _I32):
            size = 8 if wire == _I64 else 4
            if pos + size > end:
                raise ValueError("truncated fixed-size field")
            value = int.from_bytes(buf[pos:pos + size], "little")
            pos += size
            out.append(_Field(number, wire, value, first, pos))
        elif wire == _LEN:
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise ValueError("length-delimited field runs past its message")
            out.append(_Field(number, wire, pos, first, pos + length, (pos, pos + length)))
            pos += length
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def _words(buf: bytes, fields: Sequence[_Field], number: int) -> list[int]:
    """A repeated uint32, whether written unpacked (one varint a word) or packed."""
    words: list[int] = []
    for f in fields:
        if f.number != number:
            continue
        if f.wire == _VARINT:
            words.append(f.value)
        elif f.wire == _LEN:
            pos, end = f.payload
            while pos < end:
                word, pos = _varint(buf, pos, end)
                words.append(word)
        else:
            raise ValueError(f"field {number} has wire type {f.wire}")
    if any(w > 0xFFFFFFFF for w in words):
        raise ValueError(f"field {number} holds a word wider than 32 bits")
    return words


def _address(words: Sequence[int]) -> str:
    raw = b"".join(struct.pack("<I", w) for w in words)  # each word: 4 bytes in wire order
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw))
    if len(raw) == 16:
        v6 = ipaddress.IPv6Address(raw)
        mapped = v6.ipv4_mapped
        return f"::ffff:{mapped}" if mapped is not None else str(v6)
    if not raw:
        return ""
    raise ValueError(f"an address of {len(raw)} bytes")


def _address_words(address: str) -> list[int]:
    if address.startswith("::ffff:") and "." in address:
        packed = b"\0" * 10 + b"\xff\xff" + ipaddress.IPv4Address(address[7:]).packed
    else:
        packed = ipaddress.ip_address(address).packed
    return [struct.unpack("<I", packed[i:i + 4])[0] for i in range(0, len(packed), 4)]


# ---- files.img ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    start: int  # the entry's length word
    body: tuple[int, int]  # its FileEntry message
    isk: _Field | None  # its InetSkEntry, if it is an inet socket


def _entries(img: bytes) -> list[_Entry]:
    if len(img) < _HEADER:
        raise ValueError("shorter than a CRIU image header")
    if struct.unpack_from("<I", img)[0] != _COMMON_MAGIC:
        raise ValueError("not a CRIU image (bad magic)")
    out: list[_Entry] = []
    pos = _HEADER
    while pos < len(img):
        if pos + 4 > len(img):
            raise ValueError(f"truncated entry length at byte {pos}")
        (length,) = struct.unpack_from("<I", img, pos)
        body = (pos + 4, pos + 4 + length)
        if body[1] > len(img):
            raise ValueError(f"entry at byte {pos} runs past the end of the image")
        isk = [f for f in _fields(img, *body) if f.number == _FILE_ISK and f.wire == _LEN]
        out.append(_Entry(pos, body, isk[0] if isk else None))
        pos = body[1]
    return out


def _socket(img: bytes, isk: _Field) -> InetSocket:
    fields = _fields(img, *isk.payload)
    one = {f.number: f.value for f in fields if f.wire == _VARINT}
    family = {_AF_INET: 4, _AF_INET6: 6}.get(one.get(_F_FAMILY, -1))
    if family is None:
        raise ValueError(f"inet socket of family {one.get(_F_FAMILY)}")
    proto_number = one.get(_F_PROTO, -1)
    proto = _PROTOS.get(proto_number, str(proto_number))
    # The kernel keeps a UDP socket's state in the TCP numbering too (connected: established).
    state_number = one.get(_F_STATE, -1)
    state = TCP_STATES.get(state_number, str(state_number))
    return InetSocket(family, proto, state, _address(_words(img, fields, _F_SRC)),
                      one.get(_F_SPORT, 0), _address(_words(img, fields, _F_DST)),
                      one.get(_F_DPORT, 0))


def inet_sockets(files_img: bytes) -> list[InetSocket]:
    """Every inet socket entry of a CRIU `files.img`, in the image's order."""
    return [_socket(files_img, e.isk) for e in _entries(files_img) if e.isk is not None]


def check_map(address_map: Mapping[str, str]) -> dict[str, str]:
    """The map as IPv4 text, old -> new; anything else (IPv6, loopback, unspecified, a
    non-address) is refused: those must never move."""
    out: dict[str, str] = {}
    for old, new in address_map.items():
        for text in (old, new):
            try:
                addr = ipaddress.IPv4Address(text)
            except ValueError:
                raise ValueError(f"address map: {text!r} is not an IPv4 address") from None
            if addr.is_loopback or addr.is_unspecified or addr.is_multicast:
                raise ValueError(f"address map: {text} cannot be moved")
        out[str(ipaddress.IPv4Address(old))] = str(ipaddress.IPv4Address(new))
    return out


def _mapped(address: str, amap: Mapping[str, str]) -> str:
    if address.startswith("::ffff:") and address[7:] in amap:
        return "::ffff:" + amap[address[7:]]
    return amap.get(address, address)


def _rewrite_isk(img: bytes, isk: _Field, amap: Mapping[str, str]) -> bytes | None:
    """The InetSkEntry re-encoded with its addresses mapped, or None if none is mapped. The
    address words go back where the first of their field stood, unpacked as CRIU writes them."""
    fields = _fields(img, *isk.payload)
    news: dict[int, list[int]] = {}
    for number in (_F_SRC, _F_DST):
        old = _address(_words(img, fields, number))
        new = _mapped(old, amap)
        if new != old:
            news[number] = _address_words(new)
    if not news:
        return None
    out = bytearray()
    emitted: set[int] = set()
    for f in fields:
        if f.number not in news:
            out += img[f.start:f.end]
        elif f.number not in emitted:
            emitted.add(f.number)
            out += b"".join(_put_varint(f.number << 3 | _VARINT) + _put_varint(w)
                            for w in news[f.number])
    return bytes(out)


def rewrite_files_img(files_img: bytes,
                      address_map: Mapping[str, str]) -> tuple[bytes, int]:
    """`files_img` with every mapped IPv4 address replaced in both ends of every inet socket
    (IPv4-mapped IPv6 too), and the number of socket entries changed. Entries left unchanged
    are copied byte for byte."""
    amap = {k: v for k, v in check_map(address_map).items() if k != v}
    entries = _entries(files_img)
    if not amap:
        return files_img, 0
    out = bytearray(files_img[:_HEADER])
    changed = 0
    for e in entries:
        new_isk = None if e.isk is None else _rewrite_isk(files_img, e.isk, amap)
        if new_isk is None or e.isk is None:
            out += files_img[e.start:e.body[1]]
            continue
        body = (files_img[e.body[0]:e.isk.start]
                + _put_varint(_FILE_ISK << 3 | _LEN) + _put_varint(len(new_isk)) + new_isk
                + files_img[e.isk.end:e.body[1]])
        out += struct.pack("<I", len(body)) + body
        changed += 1
    return bytes(out), changed


# ---- the program ----------------------------------------------------------------------------

def _publish(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def rewrite_dir(images: str, out: str, address_map: Mapping[str, str]) -> tuple[int, int]:
    """OUT holding a link to every entry of IMAGES but files.img, written rewritten; the
    originals are only read. (inet sockets, entries rewritten)."""
    with open(os.path.join(images, FILES_IMG), "rb") as f:
        original = f.read()
    data, changed = rewrite_files_img(original, address_map)
    os.makedirs(out, exist_ok=True)
    if os.listdir(out):
        raise ValueError(f"{out} is not empty")
    for name in sorted(os.listdir(images)):
        if name != FILES_IMG:
            os.symlink(os.path.join(os.path.abspath(images), name), os.path.join(out, name))
    _publish(os.path.join(out, FILES_IMG), data)
    dfd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return len(inet_sockets(data)), changed


_USAGE = ("usage: rewrite IMAGES_DIR OUT_DIR MAP_JSON | list IMAGES_DIR"
          " | live PID (the TCP sockets of that process tree)")


def main(argv: Sequence[str]) -> int:
    try:
        if len(argv) == 4 and argv[0] == "rewrite":
            amap = json.loads(argv[3])
            if not isinstance(amap, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in amap.items()):
                raise ValueError("MAP_JSON must be an object of address strings")
            sockets, rewritten = rewrite_dir(argv[1], argv[2], amap)
            print(json.dumps({"sockets": sockets, "rewritten": rewritten}))
        elif len(argv) == 2 and argv[0] == "list":
            with open(os.path.join(argv[1], FILES_IMG), "rb") as f:
                found = inet_sockets(f.read())
            print(json.dumps([asdict(s) for s in found]))
        elif len(argv) == 2 and argv[0] == "live":
            print(json.dumps([asdict(s) for s in tree_sockets(int(argv[1]))]))
        else:
            raise ValueError(_USAGE)
    except (OSError, ValueError) as exc:  # json's errors are ValueErrors
        print(f"socket_images: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    return 0


# ---- live sockets of a process tree ---------------------------------------------------------

def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(name))
    if not os.path.isdir(f"/proc/{root}"):
        raise ValueError(f"no process {root}")
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _proc_address(hexa: str) -> str:
    raw = bytes.fromhex(hexa)
    # /proc/net/tcp* prints each 32-bit word of the address in host (little-endian) order.
    ordered = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return _address([struct.unpack("<I", ordered[i:i + 4])[0]
                     for i in range(0, len(ordered), 4)])


def parse_proc_net_tcp(text: str, family: int, inodes: set[int]) -> list[InetSocket]:
    """The sockets of /proc/net/tcp (family 4) or tcp6 (6) whose inode is in `inodes`."""
    found = []
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or int(cols[9]) not in inodes:
            continue
        (src, sport), (dst, dport) = (c.split(":") for c in cols[1:3])
        found.append(InetSocket(family, "tcp", TCP_STATES.get(int(cols[3], 16), cols[3]),
                                _proc_address(src), int(sport, 16),
                                _proc_address(dst), int(dport, 16)))
    return found


def tree_sockets(root: int) -> list[InetSocket]:
    """The TCP sockets held by the process tree under `root`, as its network namespace
    shows them."""
    inodes: set[int] = set()
    for pid in _tree(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    found: list[InetSocket] = []
    for family, path in ((4, f"/proc/{root}/net/tcp"), (6, f"/proc/{root}/net/tcp6")):
        try:
            with open(path) as f:
                found += parse_proc_net_tcp(f.read(), family, inodes)
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
    return found


PROGRAM: str
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
else:
    with open(__file__, encoding="utf-8") as _own:
        PROGRAM = _own.read()
