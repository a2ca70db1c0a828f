"""The KV cache of a drained engine (vLLM on the CPU) kept out of its snapshot: coldsnap's vLLM
plugin (deploy/capsule/coldsnap_vllm_plugin.py) gives a KV allocation's pages back to the
kernel and answers through a directory of the unit's own container; coldsnapd reads its answer,
and the capsule manifest and the receipt say per unit what was released. The plugin is loaded
here without vLLM: its pages, its loop handler and its request channel are plain Python."""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from coldsnap.engines import EngineCallFailed, SglangAdapter, VllmAdapter
from coldsnap.engines.base import kv_release
from coldsnap.formats.receipt import UnitQuiesce
from tests.unit.test_cpu_engines import _manifest

PLUGIN = Path(__file__).resolve().parents[2] / "deploy" / "capsule" / "coldsnap_vllm_plugin.py"


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("coldsnap_vllm_plugin_under_test", PLUGIN)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "REQUESTS", str(tmp_path / "vllm-kv"))
    return mod


class _Device:
    def __init__(self, kind: str) -> None:
        self.type = kind

    def __str__(self) -> str:
        return self.type


class _Storage:
    def __init__(self, ptr: int, nbytes: int, device: str) -> None:
        self.ptr, self.size, self.device = ptr, nbytes, _Device(device)

    def data_ptr(self) -> int:
        return self.ptr

    def nbytes(self) -> int:
        return self.size


class _Tensor:
    """What the plugin reads of a torch tensor: its untyped storage."""

    def __init__(self, ptr: int, nbytes: int, device: str = "cpu") -> None:
        self.storage = _Storage(ptr, nbytes, device)

    def untyped_storage(self) -> _Storage:
        return self.storage


@pytest.fixture
def kv_memory() -> Iterator[tuple[mmap.mmap, int]]:
    """16 MiB of private anonymous memory full of data, as torch allocates a KV cache."""
    mem = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mem.write(b"\x5a" * len(mem))
    buf = (ctypes.c_char * len(mem)).from_buffer(mem)
    try:
        yield mem, ctypes.addressof(buf)
    finally:
        del buf
        mem.close()


def test_the_pages_inside_the_kv_storage_are_released_and_read_as_zeros(
        plugin: ModuleType, kv_memory: tuple[mmap.mmap, int]) -> None:
    mem, addr = kv_memory
    page = mmap.PAGESIZE
    # One storage seen through two views (as vLLM binds one allocation to every layer),
    # starting and ending inside a page shared with neighbours.
    start, size = addr + 100, len(mem) - 200
    got = plugin.release_tensors([_Tensor(start, size), _Tensor(start, size)])
    assert got["storages"] == 1
    assert got["kv_bytes"] == len(mem) - 2 * page
    assert got["released_bytes"] == got["kv_bytes"]  # every page was in memory
    # a second release finds nothing in memory: nothing was touched since
    assert plugin.release_tensors([_Tensor(start, size)])["released_bytes"] == 0
    assert mem[page:len(mem) - page] == bytes(len(mem) - 2 * page)
    # the pages it shares with what lies beside it keep their data
    assert mem[:page] == b"\x5a" * page and mem[-page:] == b"\x5a" * page


class _ManyValues(_Tensor):
    """A tensor of many values, as torch's: asking it for its truth is an error."""

    def __bool__(self) -> bool:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")


def test_a_workers_kv_cache_is_found_in_its_runner_and_its_attention_layers(
        plugin: ModuleType, kv_memory: tuple[mmap.mmap, int]) -> None:
    mem, addr = kv_memory
    whole, view = _ManyValues(addr, len(mem)), _ManyValues(addr, len(mem) // 2)

    class Runner:
        kv_caches = [whole]

    class Layer:
        kv_cache = view

    class NoCache:
        kv_cache = None

    class Compilation:
        static_forward_context = {"layers.0.attn": Layer(), "layers.0.mlp": NoCache()}

    class Config:
        compilation_config = Compilation()

    class Worker:
        model_runner, vllm_config = Runner(), Config()

    class Wrapper:  # vLLM's WorkerWrapperBase, which collective_rpc calls the method on
        worker = Worker()

    assert plugin._kv_tensors(Worker()) == [whole, view]
    got = plugin._release_kv_cache(Wrapper())
    assert (got["storages"], got["kv_bytes"]) == (1, len(mem))
    with pytest.raises(RuntimeError, match="no KV cache tensor"):
        plugin._release_kv_cache(type("Bare", (), {"worker": object()})())


def test_a_kv_cache_off_the_cpu_is_refused(plugin: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="not the CPU"):
        plugin.release_tensors([_Tensor(4096, 8192, "cuda")])


class _Scheduler:
    def __init__(self, busy: bool) -> None:
        self.busy = busy

    def has_requests(self) -> bool:
        return self.busy


class _Core:
    """What the plugin uses of vLLM's engine core, recording the order of its calls."""

    def __init__(self, busy: bool = False, reset: bool = True) -> None:
        self.scheduler = _Scheduler(busy)
        self.reset = reset
        self.calls: list[str] = []

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return self.reset

    def collective_rpc(self, method: str) -> list[dict[str, int]]:
        self.calls.append(method)
        return [{"kv_bytes": 8192, "released_bytes": 4096, "storages": 1},
                {"kv_bytes": 8192, "released_bytes": 8192, "storages": 1}]


def test_the_engine_core_resets_its_prefix_cache_then_releases_every_workers_kv(
        plugin: ModuleType) -> None:
    core = _Core()
    assert plugin.release_in_loop(core) == {"kv_bytes": 16384, "released_bytes": 12288,
                                            "workers": 2}
    # no cached block may point into memory that is gone
    assert core.calls == ["reset_prefix_cache", plugin.METHOD]


@pytest.mark.parametrize(("core", "why"), [
    (_Core(busy=True), "requests running or waiting"),
    (_Core(reset=False), "could not reset its prefix cache")])
def test_the_engine_core_refuses_while_requests_hold_the_cache(
        plugin: ModuleType, core: _Core, why: str) -> None:
    doc = plugin.release_in_loop(core)
    assert why in doc["error"]
    assert plugin.METHOD not in core.calls


def test_the_request_crosses_the_containers_directory_and_is_answered_once(
        plugin: ModuleType) -> None:
    handed: list[str] = []

    def loop(nonce: str) -> None:  # the engine core's loop, answering what it was handed
        handed.append(nonce)
        plugin._LOOP_ANSWERS.put({"kv_bytes": 8192, "released_bytes": 4096, "workers": 1})

    threading.Thread(target=plugin._serve, args=(object(), loop), daemon=True).start()
    assert plugin.request_release(30) == {"kv_bytes": 8192, "released_bytes": 4096,
                                          "workers": 1}
    assert len(handed) == 1
    assert os.listdir(plugin.REQUESTS) == []  # nothing left for the snapshot to carry


def test_no_engine_answering_is_an_error_and_takes_the_request_back(
        plugin: ModuleType) -> None:
    doc = plugin.request_release(0.2)
    assert "no answer from the engine core" in doc["error"]
    assert os.listdir(plugin.REQUESTS) == []


def test_the_privileged_client_follows_no_link_the_engine_made(plugin: ModuleType,
                                                                tmp_path: Path) -> None:
    # The engine can write the directory's parent; the client runs with the container's
    # capabilities and must not write through a link it finds there.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, plugin.REQUESTS)
    with pytest.raises(OSError):
        plugin.request_release(0.2)
    assert list(elsewhere.iterdir()) == []


def test_the_client_prints_one_json_line_and_fails_on_an_error(
        plugin: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert plugin.main(["release", "0.1"]) == 1
    out = capsys.readouterr().out
    with pytest.raises(EngineCallFailed, match="no answer from the engine core"):
        kv_release(1, out)
    assert plugin.main(["nonsense"]) == 2


def test_coldsnapd_reads_the_release_answer() -> None:
    got = kv_release(0, 'vllm says hello\n{"kv_bytes": 8192, "released_bytes": 4096}\n')
    assert (got.kv_bytes, got.released_bytes) == (8192, 4096)
    with pytest.raises(EngineCallFailed, match="requests running"):
        kv_release(1, '{"error": "the engine still has requests running or waiting"}')
    with pytest.raises(EngineCallFailed, match="engine plugin"):
        kv_release(1, "", "No module named coldsnap_vllm_plugin")
    with pytest.raises(EngineCallFailed, match="released_bytes"):
        kv_release(0, '{"kv_bytes": 4096, "released_bytes": 8192}')


def test_only_vllm_on_the_cpu_has_a_release_command() -> None:
    argv = VllmAdapter().kv_release_argv("cpu")
    assert argv is not None and argv[:2] == ("/usr/bin/python3", "-I")
    assert "coldsnap_vllm_plugin" in argv
    assert VllmAdapter().kv_release_argv("gpu") is None  # its sleep drops the KV cache
    assert SglangAdapter().kv_release_argv("cpu") is None
    assert VllmAdapter().can_keep_kv_cache("cpu") and not VllmAdapter().can_keep_kv_cache("gpu")


def _cpu(**fields: Any) -> UnitQuiesce:
    return UnitQuiesce.of(_manifest(accelerator="cpu", quiesce="drain", **fields))


def test_the_receipt_says_what_each_drained_unit_kept_out_of_its_images() -> None:
    released = _cpu(kv_discarded=True, kv_released_bytes=1 << 30)
    assert (released.kv_discarded, released.kv_released_bytes) == (True, 1 << 30)
    assert f"{1 << 30} bytes kept out of its images" in released.note
    kept = _cpu(kv_discarded=False)
    assert (kept.kv_discarded, kept.kv_released_bytes) == (False, None)
    assert "KV cache kept in its images" in kept.note
    # a headless unit: its head released its workers' KV caches and counted them
    assert "released by its head unit" in _cpu(kv_discarded=True).note
    for q in (released, kept):
        assert "no sleep mode" in q.note and "cuda-checkpoint did not run" in q.note
    with pytest.raises(ValueError, match="kv_released_bytes"):
        _cpu(kv_released_bytes=-1)


def test_a_drained_unit_is_without_its_kv_cache_only_once_it_released_it() -> None:
    from dataclasses import replace

    from coldsnap.capsule.handle import UnitHandle, kv_discarded
    from coldsnap.engines import KvRelease
    from tests.unit.test_cpu_engines import _spec

    def handle(spec: Any) -> UnitHandle:
        return UnitHandle(spec, "host-0", "c0", "unit-0", "capture", ())

    cpu = handle(_spec("cpu"))
    assert kv_discarded(cpu) is False  # drained, nothing released (yet)
    cpu.kv_release = KvRelease(kv_bytes=8192, released_bytes=4096)
    assert kv_discarded(cpu) is True
    # a headless unit's workers are released by its head
    headless = handle(replace(_spec("cpu"), command=("vllm", "serve", "/m", "--headless")))
    assert kv_discarded(headless) is True
    assert kv_discarded(handle(replace(_spec("cpu"), command=(
        "vllm", "serve", "/m", "--headless"), discard_kv=False))) is False
    # a sleeping engine's sleep drops it as its spec says
    assert kv_discarded(handle(_spec("gpu"))) is True
    assert kv_discarded(handle(replace(_spec("gpu"), discard_kv=False))) is False
