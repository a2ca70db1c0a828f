"""`coldsnapd publish`, `artifacts show` of a published artifact, and `restore --artifact
REGISTRY/REPOSITORY@sha256:...`'s import, against a real registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from coldsnap.cli import main
from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.publication import published_form
from coldsnap.hosts.inventory import Inventory
from coldsnap.operations.artifact_registry import import_reference, is_registry_reference
from coldsnap.store import LocalStore
from devtools.registry_server import RegistryServer
from tests.unit.conftest import minimal_request, new_repository, stored_artifact

HOSTS = [{"name": "gpu-a", "address": "10.0.0.5", "data_dir": "/var/lib/coldsnap"}]


def _inventory(tmp_path: Path, server: RegistryServer) -> Path:
    entry: dict[str, object] = {"insecure": True} if not server.auth else {
        "ca_file": str(server.ca_file), "credentials": str(server.credentials_file)}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": HOSTS, "registries": {server.registry: entry}}))
    return path


def test_publish_prints_the_pinned_reference_last_and_show_lists_it(
        tmp_path: Path, plain_registry: RegistryServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(tmp_path / "store")
    stored = stored_artifact(store, "cap-cli")
    target = f"{plain_registry.registry}/{new_repository()}:v1"
    inventory = _inventory(tmp_path, plain_registry)
    status = main(["publish", "--artifact", "cap-cli", "--to", target, "--inventory",
                   str(inventory), "--store", str(store.root)])
    out = capsys.readouterr()
    assert status == 0, out.err
    last = out.out.strip().splitlines()[-1]
    repo = target.rsplit(":", 1)[0]
    assert last.startswith(f"{repo}@sha256:") and len(last) == len(repo) + 72
    assert store.publications("cap-cli") == [last]
    assert main(["artifacts", "show", "cap-cli", "--store", str(store.root)]) == 0
    assert f"published:       {last}" in capsys.readouterr().out
    # --json carries it too, and says nothing was sent again.
    assert main(["publish", "--artifact", stored.digest[:13], "--to", target, "--inventory",
                 str(inventory), "--store", str(store.root), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["published"] == last and result["sent_blobs"] == 0


def test_publish_from_a_request_and_its_errors(
        tmp_path: Path, auth_registry: RegistryServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(tmp_path / "store")
    stored_artifact(store, "cap-req")
    raw = minimal_request("publish-native")
    raw.update(artifact="cap-req", output=f"{auth_registry.registry}/{new_repository()}")
    request = tmp_path / "publish.json"
    request.write_text(json.dumps(raw))
    inventory = _inventory(tmp_path, auth_registry)
    base = ["publish", "--inventory", str(inventory), "--store", str(store.root)]
    assert main([*base, "--request-json", str(request)]) == 0
    out = capsys.readouterr()
    assert "(native)" in out.err and out.out.strip().endswith(
        store.publications("cap-req")[0])
    assert main([*base, "--artifact", "cap-req", "--to", "not a ref"]) == 2
    assert "--to: registry reference 'not a ref'" in capsys.readouterr().err
    assert main([*base, "--artifact", "nope", "--to", raw["output"]]) == 2
    assert "no artifact 'nope'" in capsys.readouterr().err
    # A wrong password: exit 1, the registry named, no secret printed.
    creds = json.loads(Path(str(auth_registry.credentials_file)).read_text())
    creds["auths"][auth_registry.registry] = {"username": "coldsnap", "password": "wrong"}
    bad = tmp_path / "bad-config.json"
    bad.write_text(json.dumps(creds))
    inv = yaml.safe_load(inventory.read_text())
    inv["registries"][auth_registry.registry]["credentials"] = str(bad)
    inventory.write_text(yaml.safe_dump(inv))
    assert main([*base, "--artifact", "cap-req", "--to", raw["output"]]) == 1
    err = capsys.readouterr().err
    assert f"registry {auth_registry.registry}: " in err and "401 unauthorized" in err
    assert "wrong" not in err


def test_restore_takes_a_published_reference_and_imports_it(
        tmp_path: Path, plain_registry: RegistryServer) -> None:
    source = LocalStore(tmp_path / "source")
    stored = stored_artifact(source, "cap-restore")
    inventory = _inventory(tmp_path, plain_registry)
    assert main(["publish", "--artifact", "cap-restore", "--to",
                 f"{plain_registry.registry}/{new_repository()}", "--inventory",
                 str(inventory), "--store", str(source.root)]) == 0
    ref = source.publications("cap-restore")[0]
    assert is_registry_reference(ref) and not is_registry_reference("/a/b@sha256:x")
    target = LocalStore(tmp_path / "target")
    inv = Inventory.model_validate({"hosts": HOSTS, "registries": {
        plain_registry.registry: {"insecure": True}}})
    imported = import_reference(target, ref, inv)
    # The published form: every environment value withheld (a restore request gives them).
    assert canonical_json(imported.artifact.to_json()) == \
        published_form(stored.artifact, source.read_bytes).document
    assert target.publications("cap-restore") == [ref]
    with pytest.raises(ValueError, match="by digest"):
        import_reference(target, ref.split("@")[0] + ":v1", inv)
