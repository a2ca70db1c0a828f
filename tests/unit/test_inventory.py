"""The inventory schema: what it accepts, and that every rejection names its field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.hosts.inventory import InventoryError, load_inventory, parse_inventory

GPU = {
    "uuid": "GPU-8eda9c97-5ad3-436a-8446-b2743dd0c187",
    "name": "NVIDIA GB10",
    "compute_capability": "12.1",
    "memory_bytes": 128 * 2**30,
}


def host(**over: Any) -> dict[str, Any]:
    h: dict[str, Any] = {"name": "gpu-a", "address": "10.0.0.5", "data_dir": "/var/lib/coldsnap"}
    h.update(over)
    return h


def problems(doc: Any) -> list[str]:
    with pytest.raises(InventoryError) as info:
        parse_inventory(doc, source="inv.yaml")
    return info.value.problems


def test_minimal_host_gets_documented_defaults() -> None:
    inv = parse_inventory({"hosts": [host()]}, source="/etc/coldsnap/inventory.yaml")
    h = inv.get("gpu-a")
    assert (h.port, h.user, h.docker_socket, h.host_key_policy) == (
        22,
        "root",
        "/var/run/docker.sock",
        "strict",
    )
    assert h.known_hosts == Path("~/.ssh/known_hosts").expanduser()
    assert not h.simulated and h.simulated_gpus is None and h.proxy_jump is None


def test_full_simulated_host(tmp_path: Path) -> None:
    doc = {
        "hosts": [
            host(
                port=2222,
                user="ops",
                identity_file="keys/id",
                known_hosts="kh",
                proxy_jump="bastion.example:22",
                docker_socket=None,
                simulated=True,
                driver_version="610.43.02",
                simulated_gpus=[GPU],
            )
        ]
    }
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(doc))
    h = load_inventory(path).hosts[0]
    # Relative key paths are relative to the inventory file, not to the working directory.
    assert h.identity_file == tmp_path / "keys/id"
    assert h.known_hosts == tmp_path / "kh"
    assert h.docker_socket is None
    assert h.simulated_gpus is not None and h.simulated_gpus[0].compute_capability == "12.1"


def test_simulated_gpus_only_on_a_simulated_host() -> None:
    assert problems(
        {"hosts": [host(), host(name="b", simulated_gpus=[GPU], driver_version="1")]}
    ) == ["hosts[1].simulated_gpus: only a host with `simulated: true` may carry simulated GPUs"]


def test_driver_version_only_on_a_simulated_host() -> None:
    [p] = problems({"hosts": [host(driver_version="610.43.02")]})
    assert p.startswith("hosts[0].driver_version:")


def test_simulated_gpus_need_a_driver_version() -> None:
    [p] = problems({"hosts": [host(simulated=True, simulated_gpus=[GPU])]})
    assert p.startswith("hosts[0].driver_version:")


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"port": 70000}, "hosts[0].port"),
        ({"port": "22"}, "hosts[0].port"),  # strict: a quoted number is a mistake
        ({"data_dir": "relative/dir"}, "hosts[0].data_dir"),
        ({"data_dir": "/x/../.."}, "hosts[0].data_dir"),
        ({"data_dir": "/"}, "hosts[0].data_dir"),
        ({"data_dir": "/var/lib/coldsnap/"}, "hosts[0].data_dir"),
        ({"docker_socket": "docker.sock"}, "hosts[0].docker_socket"),
        ({"name": "has space"}, "hosts[0].name"),
        ({"host_key_policy": "no"}, "hosts[0].host_key_policy"),
        ({"colour": "blue"}, "hosts[0].colour"),
        (
            {"simulated": True, "driver_version": "1", "simulated_gpus": [dict(GPU, uuid="0")]},
            "hosts[0].simulated_gpus[0].uuid",
        ),
        (
            {
                "simulated": True,
                "driver_version": "1",
                "simulated_gpus": [dict(GPU, compute_capability=12.1)],
            },
            "hosts[0].simulated_gpus[0].compute_capability",
        ),
    ],
)
def test_bad_field_is_named(over: dict[str, Any], field: str) -> None:
    found = problems({"hosts": [host(**over)]})
    assert any(p.startswith(field + ":") for p in found), found


def test_missing_field_is_named() -> None:
    h = host()
    del h["data_dir"]
    assert problems({"hosts": [h]}) == ["hosts[0].data_dir: Field required"]


def test_duplicate_names_rejected() -> None:
    [p] = problems({"hosts": [host(), host(address="10.0.0.6")]})
    assert p.startswith("hosts[1].name: duplicate")


def test_not_a_mapping_and_empty() -> None:
    assert problems(["x"])[0].startswith("top level")
    assert problems({"hosts": []})[0].startswith("hosts:")


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="cannot read"):
        load_inventory(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts: [\n")
    with pytest.raises(InventoryError, match="not valid YAML"):
        load_inventory(bad)


def test_repeated_key_is_refused_not_last_one_wins(tmp_path: Path) -> None:
    # With yaml.safe_load the second address silently replaced the first.
    path = tmp_path / "inv.yaml"
    path.write_text("hosts:\n  - name: gpu-a\n    address: 10.0.0.5\n    address: 10.0.0.6\n"
                    "    data_dir: /var/lib/coldsnap\n")
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    [problem] = info.value.problems
    assert problem.startswith("inventory is not valid YAML: duplicate key 'address'")
    assert "line 4" in problem


def test_json_inventory_refuses_repeated_keys_too(tmp_path: Path) -> None:
    path = tmp_path / "inv.json"
    path.write_text('{"hosts": [], "hosts": [{"name": "gpu-a"}]}')
    with pytest.raises(InventoryError, match="inventory is not valid JSON: duplicate key 'hosts'"):
        load_inventory(path)


def test_values_json_cannot_carry_are_named(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"hosts": [host()]}) + "extra: !!binary aGVsbG8=\n")
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    assert info.value.problems == ["extra: a bytes value is not JSON"]


def test_a_date_stays_the_string_it_was_written_as(tmp_path: Path) -> None:
    # A YAML timestamp would become a date, which the strict schema refuses as a driver version.
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"hosts": [host(simulated=True)]}).replace(
        "simulated: true", "simulated: true\n  driver_version: 2026-01-01"))
    assert load_inventory(path).get("gpu-a").driver_version == "2026-01-01"


def test_cli_exits_2_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"hosts": [host(simulated_gpus=[GPU])]}))
    r = subprocess.run(
        [sys.executable, "-m", "coldsnap", "hosts", "probe", "--inventory", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "hosts[0].simulated_gpus" in r.stderr
    assert r.stdout == ""
