"""The restore exec's socket rewrite (criu_restore._REWRITE), run by sh with the capsule
program on a real CRIU files.img: a copy in the work directory, the staged set untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from coldsnap.capsule.criu_restore import _REWRITE, _REWRITE_FAILED
from coldsnap.capsule.socket_images import PROGRAM, inet_sockets
from coldsnap.formats.capsule import InetSocketRecord
from coldsnap.session_moves import changed, crossing_hosts

FIXTURE = Path(__file__).parent / "fixtures" / "criu_sockets" / "a-files.img"


def run(tmp_path: Path, amap: dict[str, str]) -> subprocess.CompletedProcess[str]:
    images = tmp_path / "images"
    if not images.exists():
        images.mkdir()
        shutil.copy(FIXTURE, images / "files.img")
        (images / "pages-1.img").write_bytes(b"pages")
        images.chmod(0o555)  # the staged set is mounted read-only
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    # python3 in the capsule: this interpreter here.
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    if not (bindir / "python3").exists():
        (bindir / "python3").symlink_to(sys.executable)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "COLDSNAP_REWRITE_PROGRAM": PROGRAM,
           "COLDSNAP_ADDRESS_MAP": json.dumps(amap) if amap else ""}
    script = f'images={images} work={work}\n' + _REWRITE + 'echo "images=$images"\n'
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                          check=False)


def test_the_rewrite_writes_a_copy_and_points_criu_at_it(tmp_path: Path) -> None:
    amap = {"198.18.0.2": "198.18.0.4", "198.18.0.3": "198.18.0.5"}
    out = run(tmp_path, amap)
    assert out.returncode == 0, out.stdout + out.stderr
    copy = tmp_path / "work" / "images"
    assert out.stdout.strip().endswith(f"images={copy}")
    assert (copy / "pages-1.img").is_symlink() and (copy / "pages-1.img").read_bytes() == b"pages"
    assert not (copy / "files.img").is_symlink()
    assert (tmp_path / "images" / "files.img").read_bytes() == FIXTURE.read_bytes()
    after = [InetSocketRecord.model_validate(vars(s))
             for s in inet_sockets((copy / "files.img").read_bytes())]
    before = [InetSocketRecord.model_validate(vars(s)) for s in inet_sockets(FIXTURE.read_bytes())]
    assert changed(before, amap) == 5  # the listener on .2, the UDP pair, three TCP pairs
    named = {x.src.removeprefix("::ffff:") for x in crossing_hosts(after)}
    assert named == {"198.18.0.4"}


def test_no_map_restores_from_the_staged_set_itself(tmp_path: Path) -> None:
    out = run(tmp_path, {})
    assert out.returncode == 0
    assert out.stdout.strip() == f"images={tmp_path / 'images'}"
    assert not (tmp_path / "work" / "images").exists()


def test_a_bad_map_fails_the_restore_with_the_programs_reason(tmp_path: Path) -> None:
    out = run(tmp_path, {"198.18.0.2": "not-an-address"})
    assert out.returncode == _REWRITE_FAILED
    assert "socket_images" in out.stdout
