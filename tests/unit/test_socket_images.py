"""The inet sockets of real CRIU `files.img` images, read and re-addressed byte by byte.

The fixtures come from CRIU 4.2.1 (tests/unit/fixtures/criu_sockets/make_fixtures.py): side a
(198.18.0.2) listens on IPv4, dual-stack and loopback (with a loopback pair), holds a unix pair,
a unix listener and a connected UDP socket, and has accepted three connections from side b
(198.18.0.3): one IPv4, two on the dual-stack listener (IPv4-mapped IPv6)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from coldsnap.capsule import socket_images as si
from coldsnap.capsule.socket_images import InetSocket, inet_sockets, rewrite_files_img

FIXTURES = Path(__file__).parent / "fixtures" / "criu_sockets"
A = (FIXTURES / "a-files.img").read_bytes()
B = (FIXTURES / "b-files.img").read_bytes()
MOVE = {"198.18.0.2": "198.18.0.4", "198.18.0.3": "198.18.0.5"}
BACK = {v: k for k, v in MOVE.items()}


def _moved(s: InetSocket, amap: dict[str, str]) -> InetSocket:
    def one(addr: str) -> str:
        if addr.startswith("::ffff:") and addr[7:] in amap:
            return "::ffff:" + amap[addr[7:]]
        return amap.get(addr, addr)
    return replace(s, src=one(s.src), dst=one(s.dst))


def test_every_inet_socket_of_side_a() -> None:
    found = inet_sockets(A)
    assert set(found) == {
        InetSocket(4, "tcp", "listen", "198.18.0.2", 7001, "0.0.0.0", 0),
        InetSocket(6, "tcp", "listen", "::", 7002, "::", 0),
        InetSocket(4, "tcp", "listen", "127.0.0.1", 7003, "0.0.0.0", 0),
        *(s for s in found if s.src == s.dst == "127.0.0.1"),
        InetSocket(4, "udp", "established", "198.18.0.2", 7004, "198.18.0.3", 7004),
        *(s for s in found if s.state == "established" and s.dst.endswith("198.18.0.3")
          and s.proto == "tcp"),
    }
    assert len(found) == 9
    loop = [s for s in found if s.src == s.dst == "127.0.0.1"]
    first, second = loop  # the loopback pair: each the other's peer, one of them on 7003
    assert (first.sport, first.dport) == (second.dport, second.sport)
    assert 7003 in (first.sport, second.sport)
    accepted = [s for s in found if s.proto == "tcp" and s.dst.endswith("198.18.0.3")]
    assert sorted((s.family, s.src, s.sport) for s in accepted) == [
        (4, "198.18.0.2", 7001), (6, "::ffff:198.18.0.2", 7002), (6, "::ffff:198.18.0.2", 7002)]


def test_side_b_holds_the_peer_ends_of_a() -> None:
    a_conns = {(s.sport, s.dport) for s in inet_sockets(A)
               if s.state == "established" and s.proto == "tcp" and "198.18.0.3" in s.dst}
    b = inet_sockets(B)
    assert len(b) == 3 and all(s.state == "established" for s in b)
    assert {(s.dport, s.sport) for s in b} == a_conns
    assert {s.family for s in b} == {4, 6}
    assert all(s.src.endswith("198.18.0.3") and s.dst.endswith("198.18.0.2") for s in b)


@pytest.mark.parametrize("amap", [{}, {"198.18.0.2": "198.18.0.2"}, {"198.18.0.99": "198.18.0.9"}])
@pytest.mark.parametrize("img", [A, B], ids=["a", "b"])
def test_a_map_that_moves_nothing_returns_the_image_byte_for_byte(
        img: bytes, amap: dict[str, str]) -> None:
    assert rewrite_files_img(img, amap) == (img, 0)


@pytest.mark.parametrize(("img", "changed"), [(A, 5), (B, 3)], ids=["a", "b"])
def test_the_whole_map_moves_both_ends_of_every_socket(img: bytes, changed: int) -> None:
    new, count = rewrite_files_img(img, MOVE)
    assert count == changed
    assert inet_sockets(new) == [_moved(s, MOVE) for s in inet_sockets(img)]
    # Loopback, wildcards and the unix sockets stay exactly as they were.
    untouched = [s for s in inet_sockets(new) if not ({s.src, s.dst} & {
        "198.18.0.4", "198.18.0.5", "::ffff:198.18.0.4", "::ffff:198.18.0.5"})]
    assert all(s in inet_sockets(img) for s in untouched)
    assert rewrite_files_img(new, BACK) == (img, changed)


def test_non_inet_entries_are_copied_as_they_were() -> None:
    new, _ = rewrite_files_img(A, MOVE)
    old_entries = [A[e.start:e.body[1]] for e in si._entries(A) if e.isk is None]
    new_entries = [new[e.start:e.body[1]] for e in si._entries(new) if e.isk is None]
    assert len(old_entries) >= 4  # unix pair, unix listener, the epoll-free rest
    assert old_entries == new_entries


def test_an_address_whose_encoding_grows_round_trips() -> None:
    # 198.18.0.3's word needs 4 varint bytes and 198.18.0.200's 5: every length grows.
    amap = {"198.18.0.3": "198.18.0.200"}
    new, count = rewrite_files_img(B, amap)
    assert count == 3 and len(new) > len(B)
    assert {s.src for s in inet_sockets(new)} == {"198.18.0.200", "::ffff:198.18.0.200"}
    assert rewrite_files_img(new, {"198.18.0.200": "198.18.0.3"}) == (B, 3)


def test_only_mapped_addresses_move() -> None:
    new, count = rewrite_files_img(A, {"198.18.0.3": "198.18.0.9"})
    assert count == 4  # the UDP socket and the three accepted connections
    srcs = {s.src for s in inet_sockets(new)}
    assert "198.18.0.2" in srcs and "::ffff:198.18.0.2" in srcs


@pytest.mark.parametrize("bad", [
    {"127.0.0.1": "198.18.0.9"}, {"198.18.0.2": "127.0.0.1"}, {"0.0.0.0": "198.18.0.9"},
    {"::1": "198.18.0.9"}, {"198.18.0.2": "::ffff:198.18.0.9"}, {"198.18.0.2": "host-1"},
])
def test_a_map_naming_what_must_never_move_is_refused(bad: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="address map"):
        rewrite_files_img(A, bad)


@pytest.mark.parametrize("data", [b"", b"\x19\x43\x56\x54", b"\0" * 8, A[:-1], A[:10],
                                  A[:8] + b"\xff\xff\xff\x7f"])
def test_malformed_images_raise_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        inet_sockets(data)
    with pytest.raises(ValueError):
        rewrite_files_img(data, MOVE)


def test_damaged_images_never_fail_other_than_value_error() -> None:
    rng = random.Random(34)
    for _ in range(300):
        data = bytearray(A)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(8, len(data))] = rng.randrange(256)
        try:
            rewrite_files_img(bytes(data), MOVE)
            inet_sockets(bytes(data))
        except ValueError:
            pass


def test_packed_address_words_are_read_too() -> None:
    # proto2 writes repeated uint32 unpacked, but a packed encoder's output must read the same.
    words = si._address_words("198.18.0.7")
    isk = (bytes([3 << 3, 2]) + bytes([5 << 3, 6]) + bytes([6 << 3, 10]) + bytes([7 << 3])
           + si._put_varint(80) + bytes([11 << 3 | 2]) + si._put_varint(len(
               b := b"".join(si._put_varint(w) for w in words))) + b)
    entry = bytes([1 << 3, 2, 2 << 3, 1, 4 << 3 | 2]) + si._put_varint(len(isk)) + isk
    img = A[:8] + len(entry).to_bytes(4, "little") + entry
    assert inet_sockets(img) == [InetSocket(4, "tcp", "listen", "198.18.0.7", 80, "", 0)]
    new, count = rewrite_files_img(img, {"198.18.0.7": "198.18.0.8"})
    assert count == 1 and inet_sockets(new)[0].src == "198.18.0.8"


def _program(*args: str) -> subprocess.CompletedProcess[str]:
    # -I: no site-packages and no repo on the path, as with the capsule's bare python3.
    return subprocess.run([sys.executable, "-I", "-c", si.PROGRAM, *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_the_program_rewrites_a_copy_of_the_image_set(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "files.img").write_bytes(A)
    (images / "pages-1.img").write_bytes(b"pages")
    os.chmod(images, 0o555)  # the content-addressed originals are read-only
    out = tmp_path / "out"
    res = _program("rewrite", str(images), str(out), json.dumps(MOVE))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"sockets": 9, "rewritten": 5}
    assert (images / "files.img").read_bytes() == A
    assert (out / "files.img").read_bytes() == rewrite_files_img(A, MOVE)[0]
    assert not (out / "files.img").is_symlink()
    assert os.readlink(out / "pages-1.img") == str(images / "pages-1.img")
    assert sorted(p.name for p in out.iterdir()) == ["files.img", "pages-1.img"]
    listed = _program("list", str(out))
    assert [InetSocket(**s) for s in json.loads(listed.stdout)] == inet_sockets(
        rewrite_files_img(A, MOVE)[0])


@pytest.mark.parametrize("case", ["bad-json", "not-a-map", "bad-address", "no-images",
                                  "out-not-empty", "bad-image", "usage"])
def test_the_program_refuses_bad_input_in_one_line(tmp_path: Path, case: str) -> None:
    images, out = tmp_path / "images", tmp_path / "out"
    images.mkdir()
    (images / "files.img").write_bytes(b"junk" * 4 if case == "bad-image" else A)
    if case == "out-not-empty":
        out.mkdir()
        (out / "x").write_text("x")
    amap = {"bad-json": "{", "not-a-map": "[1]", "bad-address": '{"198.18.0.2": "x"}'}.get(
        case, json.dumps(MOVE))
    src = tmp_path / "none" if case == "no-images" else images
    args = ["rewrite", str(src), str(out), amap] if case != "usage" else ["move", "x"]
    res = _program(*args)
    assert res.returncode == 2
    assert res.stderr.startswith("socket_images: ") and res.stderr.count("\n") == 1
    assert res.stdout == ""


def test_proc_net_tcp_lines_are_read_in_host_order() -> None:
    v4 = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid "
          " timeout inode\n"
          "   0: 020012C6:1B59 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0 0 "
          "111 1 0 100 0 0 10 0\n"
          "   1: 020012C6:1B59 030012C6:E4C4 01 00000000:00000000 00:00000000 00000000  0 0 "
          "222 1 0 100 0 0 10 0\n"
          "   2: 0100007F:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0 0 "
          "333 1 0 100 0 0 10 0\n")
    assert si.parse_proc_net_tcp(v4, 4, {111, 222}) == [
        InetSocket(4, "tcp", "listen", "198.18.0.2", 7001, "0.0.0.0", 0),
        InetSocket(4, "tcp", "established", "198.18.0.2", 7001, "198.18.0.3", 58564)]
    v6 = ("  sl  local_address remote_address st\n"
          "   0: 0000000000000000FFFF0000020012C6:1B5A 0000000000000000FFFF0000030012C6:B412 01"
          " 00000000:00000000 00:00000000 00000000 0 0 444 1\n")
    assert si.parse_proc_net_tcp(v6, 6, {444}) == [
        InetSocket(6, "tcp", "established", "::ffff:198.18.0.2", 7002, "::ffff:198.18.0.3",
                   46098)]


def test_the_live_sockets_of_this_process_tree() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        port = server.getsockname()[1]
        res = _program("live", str(os.getpid()))
        assert res.returncode == 0, res.stderr
        found = [InetSocket(**s) for s in json.loads(res.stdout)]
        assert InetSocket(4, "tcp", "listen", "127.0.0.1", port, "0.0.0.0", 0) in found
        assert InetSocket(4, "tcp", "established", "127.0.0.1", client.getsockname()[1],
                          "127.0.0.1", port) in found
    assert _program("live", "999999999").returncode == 2
