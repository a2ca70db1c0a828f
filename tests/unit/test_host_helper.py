"""The one host-side helper program (coldsnap.hosts.helper), run here exactly as a host runs
it (`python3 -c PROGRAM MODE ARGS`): one text for every mode, the stamps hosts already hold
read as before, and the modes test_remote_helper and test_criu_image_objects do not reach."""

from __future__ import annotations

import ast
import collections
import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

from coldsnap.hosts.helper import PARTS, PROGRAM, helper_argv
from coldsnap.hosts.helper.common import (
    EXIT_ABSENT,
    EXIT_MISMATCH,
    EXIT_OFFSET,
    EXIT_REFUSED,
    EXIT_USAGE,
)
from coldsnap.hosts.helper.stamps import SET_STAMP_ATTR, STAMP_ATTR, set_stamp
from coldsnap.hosts.transfer.protocol import parse_part


def run(mode: str, *args: str, data: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(helper_argv(mode, *args), input=data, capture_output=True,
                          timeout=30, check=False)


def test_the_program_is_one_text_of_every_part_that_python_3_8_can_read() -> None:
    tree = ast.parse(PROGRAM, feature_version=(3, 8))
    assert PROGRAM.startswith("from __future__ import annotations\n")
    assert PROGRAM.count("from __future__") == 1 and "from coldsnap." not in PROGRAM
    names = collections.Counter(n.name for n in tree.body
                                if isinstance(n, ast.FunctionDef | ast.ClassDef))
    assert [n for n, k in names.items() if k > 1] == []  # no part shadows another's name
    assert {"put", "get", "recv", "commit", "reap", "pack", "place", "finish", "layers",
            "check_set", "holdings", "main"} <= set(names)
    assert PARTS[-1] == "main" and PROGRAM.rstrip().endswith("sys.exit(main(sys.argv[1:]))")


def test_an_unknown_mode_or_a_wrong_argument_count_is_a_usage_error() -> None:
    assert run("bogus").returncode == EXIT_USAGE
    usage = run("pack", "/nonexistent")
    assert usage.returncode == EXIT_USAGE
    assert usage.stderr == b"usage: pack|place|finish|layers ARGS\n"


def test_a_file_stamp_in_the_format_hosts_hold_is_read(tmp_path: Path) -> None:
    path = tmp_path / "obj"
    path.write_bytes(b"bytes")
    st = path.stat()
    other = hashlib.sha256(b"other").hexdigest()
    # "HEX SIZE MTIME_NS", as every earlier helper wrote it: believed, the file is not read.
    os.setxattr(path, STAMP_ATTR, f"{other} {st.st_size} {st.st_mtime_ns}".encode())
    assert parse_part(run("stat", str(path)).stdout) == (5, other)


def test_get_sends_from_an_offset_and_the_whole_files_digest(tmp_path: Path) -> None:
    path = tmp_path / "obj"
    payload = os.urandom(3 * 1024 * 1024 + 5)
    path.write_bytes(payload)
    out = run("get", str(path), "1000")
    assert out.returncode == 0, out.stderr
    header, rest = out.stdout.split(b"\n", 1)
    assert header == f"size {len(payload)}".encode()
    assert rest == payload[1000:] + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    assert run("get", str(path), str(len(payload) + 1)).returncode == EXIT_OFFSET
    assert run("get", str(tmp_path / "missing"), "0").returncode == EXIT_USAGE


def test_recv_publishes_a_candidate_named_by_its_digest_and_commit_renames_it(
        tmp_path: Path) -> None:
    part, final = tmp_path / "d" / "obj.part", tmp_path / "d" / "obj"
    payload = os.urandom(1 << 20)
    digest = hashlib.sha256(payload).hexdigest()
    got = run("recv", str(part), "0", str(len(payload)), data=payload)
    assert got.returncode == 0, got.stderr
    assert got.stdout == f"got {len(payload)} {digest}\n".encode()
    candidate = Path(f"{part}.{digest}")
    assert candidate.read_bytes() == payload and not part.exists()
    assert os.getxattr(candidate, STAMP_ATTR).split()[0] == digest.encode()
    assert run("commit", str(candidate), str(final)).returncode == 0
    assert final.read_bytes() == payload and not candidate.exists()
    assert run("commit", str(candidate), str(final)).returncode == EXIT_MISMATCH


def _image_set(root: Path) -> list[object]:
    """A published image set of one file and its plan ([[hex, size, copies]])."""
    root.mkdir()
    data = os.urandom(5000)
    (root / "pages-1.img").write_bytes(data)
    return [[hashlib.sha256(data).hexdigest(), len(data), [[["pages-1.img", 0, 0, len(data)]]]]]


def test_holdings_answers_for_files_and_image_sets_in_one_call(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"plain")
    good, bad = tmp_path / "good", tmp_path / "bad"
    plan = _image_set(good)
    _image_set(bad)  # other bytes than the plan says
    request = {"paths": [str(plain), str(tmp_path / "missing")],
               "sets": [[str(good), plan], [str(bad), plan], [str(tmp_path / "none"), plan]]}
    out = run("holdings", data=json.dumps(request).encode())
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["files"] == [f"part 5 {hashlib.sha256(b'plain').hexdigest()}\n", "absent\n"]
    codes = [code for code, _why in answer["sets"]]
    assert codes == [0, EXIT_MISMATCH, EXIT_ABSENT]
    # A set that read back whole is stamped, in the format set_stamp defines.
    assert os.getxattr(good, SET_STAMP_ATTR).decode() == set_stamp(str(good), plan)
    assert SET_STAMP_ATTR not in os.listxattr(bad)


def test_a_set_stamp_in_the_format_hosts_hold_is_read(tmp_path: Path) -> None:
    root = tmp_path / "set"
    plan = _image_set(root)
    # Written as every earlier helper wrote it; it vouches for these files as they are now,
    # so the check believes it (a plan naming other bytes then answers 0 without reading).
    liar = [[hashlib.sha256(b"other").hexdigest(), 5000, plan[0][2]]]  # type: ignore[index]
    os.setxattr(root, SET_STAMP_ATTR, set_stamp(str(root), liar).encode())
    request = {"paths": [], "sets": [[str(root), liar]]}
    answer = json.loads(run("holdings", data=json.dumps(request).encode()).stdout)
    assert answer["sets"] == [[0, ""]]


def _saved_image(path: Path, layers: list[str]) -> None:
    """A `docker save` tar: a directory per layer, a manifest naming them in order, and a
    layer saved as a link to an identical one."""
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))

        for layer in layers:
            d = tarfile.TarInfo(layer)
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
            add(f"{layer}/layer.tar", layer.encode() * 100)
        link = tarfile.TarInfo(f"{layers[-1]}/same.tar")
        link.type, link.linkname = tarfile.SYMTYPE, f"../{layers[0]}/layer.tar"
        tar.addfile(link)
        add("manifest.json", json.dumps([{"Config": "c.json", "RepoTags": None,
                                          "Layers": [f"{x}/layer.tar" for x in layers]}
                                         ]).encode())
        add("c.json", b"{}")


def test_layers_keeps_what_is_above_the_base_and_carries_linked_bytes(tmp_path: Path) -> None:
    saved, out = tmp_path / "saved.tar", tmp_path / "out.tar"
    _saved_image(saved, ["base", "mid", "top"])
    res = run("layers", str(saved), str(out), "1")
    assert res.returncode == 0, res.stderr
    body = out.read_bytes()
    assert res.stdout == f"{hashlib.sha256(body).hexdigest()} {len(body)}\n".encode()
    assert oct(out.stat().st_mode & 0o777) == oct(0o600)
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        same = tar.extractfile("top/same.tar")
        assert same is not None and same.read() == b"base" * 100  # the link's bytes
    assert {"mid/layer.tar", "top/layer.tar", "manifest.json", "c.json"} <= names
    assert not any(n.startswith("base") for n in names)
    assert not (tmp_path / "out.tar.partial").exists()
    too_many = run("layers", str(saved), str(out), "4")
    assert too_many.returncode == EXIT_USAGE
    assert too_many.stderr == b"the image has 3 layers, fewer than its base's 4\n"


def test_seed_copies_a_staged_cache_without_following_links_and_says_what_it_copied(
        tmp_path: Path) -> None:
    src, dst = tmp_path / "staged", tmp_path / "volume" / "runtime"
    (src / "inductor").mkdir(parents=True)
    (src / "seed.txt").write_text("warm\n")
    (src / "inductor" / "k.py").write_bytes(b"x" * 3000)
    os.chmod(src / "inductor" / "k.py", 0o600)
    (tmp_path / "secret").write_text("outside\n")
    (src / "escape").symlink_to(tmp_path / "secret")
    (dst / "inductor").mkdir(parents=True)
    (dst / "inductor" / "image-own.txt").write_text("kept\n")
    res = run("seed", str(src), str(dst))
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout)
    assert answer["files"] == 2 and answer["bytes"] == 5 + 3000
    assert (dst / "seed.txt").read_text() == "warm\n"
    assert (dst / "inductor" / "k.py").stat().st_mode & 0o777 == 0o600
    assert (dst / "inductor" / "image-own.txt").read_text() == "kept\n"
    # A link stays a link: what it names is not copied in.
    assert (dst / "escape").is_symlink()
    # The digest is of the tree, wherever it lies.
    other = tmp_path / "elsewhere"
    again = json.loads(run("seed", str(src), str(other)).stdout)
    assert again["digest"] == answer["digest"]
    (src / "seed.txt").write_text("cold\n")
    assert json.loads(run("seed", str(src), str(other)).stdout)["digest"] != answer["digest"]


def test_seed_refuses_a_missing_directory_or_a_link_to_one(tmp_path: Path) -> None:
    res = run("seed", str(tmp_path / "gone"), str(tmp_path / "dst"))
    assert res.returncode == EXIT_REFUSED and b"not a directory" in res.stderr
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert run("seed", str(tmp_path / "link"), str(tmp_path / "dst")).returncode == EXIT_REFUSED
    assert not (tmp_path / "dst").exists()
