"""The test capsule's build (devtools/capsule_build.py): the same inputs give the same rootfs
bytes (so the same image digest and a cache hit), and every engine module, link and directory
the capsule layout promises is in it."""

from __future__ import annotations

import ast
import io
import sys
import tarfile
from pathlib import Path

import pytest

from devtools import capsule_build as test_capsule


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base.tar"
    with tarfile.open(base, "w") as tar:
        data = b"debian\n"
        ti = tarfile.TarInfo("./etc/debian_version")
        ti.size, ti.mtime = len(data), 1
        tar.addfile(ti, io.BytesIO(data))
    return base


def test_the_same_inputs_compose_the_same_bytes(tmp_path: Path) -> None:
    base = _base(tmp_path)
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    test_capsule.compose(base, a)
    test_capsule.compose(base, b)
    assert a.read_bytes() == b.read_bytes()


def test_the_rootfs_holds_the_engine_the_links_and_the_directories(tmp_path: Path) -> None:
    out = tmp_path / "rootfs.tar"
    test_capsule.compose(_base(tmp_path), out)
    with tarfile.open(out) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
    engine = members["opt/coldsnap-test/engine.py"]
    assert engine.isfile() and engine.mode == 0o755 and engine.mtime == test_capsule.EPOCH
    assert members["usr/local/bin/cuda-checkpoint"].linkname == "cuda-checkpoint-sim"
    assert members["usr/local/bin/capsule-init"].linkname.endswith("capsule_init.py")
    # Every absolute link lands on a file the rootfs holds (the production programs included).
    for target in test_capsule.LINKS.values():
        if target.startswith("/"):
            assert members[target.removeprefix("/")].isfile(), target
    assert all(members[d].isdir() for d in test_capsule.DIRS)
    assert "etc/debian_version" in members  # the base is kept under the additions
    # What the capsule's programs import is the standard library or a module beside them.
    for name in test_capsule.FILES | test_capsule.CAPSULE_FILES:
        for imported in _imports(tar_bytes(out, name)):
            assert (imported in sys.stdlib_module_names
                    or f"opt/coldsnap-test/{imported}.py" in members), (name, imported)


def tar_bytes(path: Path, name: str) -> bytes:
    with tarfile.open(path) as tar:
        f = tar.extractfile(f"./{name}")
        assert f is not None
        return f.read()


def _imports(source: bytes) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out - {"__future__"}


def test_a_changed_source_changes_the_inputs_key(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    base = _base(tmp_path)
    before = test_capsule.inputs_key(base)
    sources = tmp_path / "sources"
    sources.mkdir()
    for src, _ in test_capsule.FILES.values():
        (sources / src).write_bytes((test_capsule.SOURCES / src).read_bytes())
    monkeypatch.setattr(test_capsule, "SOURCES", sources)
    assert test_capsule.inputs_key(base) == before
    (sources / "engine.py").write_bytes(b"# changed\n")
    assert test_capsule.inputs_key(base) != before


def test_the_gpu_capsule_dockerfiles_copy_the_programs_beside_them() -> None:
    """deploy/capsule/ is the GPU capsules' build context for what the repository provides."""
    deploy = test_capsule.CAPSULE_SOURCES
    copied = [line.split()[1] for dockerfile in sorted(deploy.glob("Dockerfile.*"))
              for line in dockerfile.read_text().splitlines()
              if line.startswith("COPY ") and line.split()[1].endswith(".py")]
    assert sorted(set(copied)) == ["capsule_http.py", "capsule_init.py"]
    assert all((deploy / name).is_file() for name in copied)
    assert sorted(src for src, _ in test_capsule.CAPSULE_FILES.values()) == sorted(set(copied))
