"""Sharded per-layer checkpoints: round trip, completeness, repartitioning, errors."""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from raypipe.checkpoint import store as ckpt
from raypipe.errors import CheckpointError
from raypipe.filesystem import filesystem_for


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def save_model(root, step: int, model: nn.Sequential, stages: list[list[int]], extra=None,
               blobs=()) -> dict[int, ckpt.StoredFile]:
    """Save as pipeline stages would: each stage writes its own global layers, in parallel."""
    def save_stage(layer_indices: list[int]) -> dict[int, ckpt.StoredFile]:
        return {index: ckpt.write_layer(root, step, index, model[index].state_dict()) for index in layer_indices}

    with ThreadPoolExecutor(len(stages)) as pool:
        files = {index: file for part in pool.map(save_stage, stages) for index, file in part.items()}
    ckpt.write_manifest(root, step, files, extra or {}, blobs=blobs)
    return files


def test_round_trip_loads_into_a_different_partition(tmp_path):
    root = tmp_path / "ckpt"
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    blob = ckpt.write_blob(root, 120, "optim_00000", optimizer.state_dict())
    assert blob.name == "optim_00000.pt"
    files = save_model(root, 120, model, stages=[[0, 1], [2, 3, 4]], extra={"data": {"next_step": 121}},
                       blobs=[blob])

    assert {index: file.name for index, file in files.items()} == {index: f"layer_{index:05d}.pt" for index in range(5)}
    step_dir = root / "step_00000120"
    assert sorted(os.listdir(step_dir)) == [*(f"layer_{i:05d}.pt" for i in range(5)), "manifest.json", "optim_00000.pt"]
    manifest = ckpt.read_manifest(root, 120)
    assert manifest["step"] == 120 and manifest["num_layers"] == 5
    assert manifest["extra"] == {"data": {"next_step": 121}}
    assert manifest["sizes"]["layer_00002.pt"] == (step_dir / "layer_00002.pt").stat().st_size
    assert manifest["sha256"]["layer_00002.pt"] == hashlib.sha256((step_dir / "layer_00002.pt").read_bytes()).hexdigest()
    assert manifest["sha256"]["optim_00000.pt"] == blob.sha256
    assert manifest["blobs"] == ["optim_00000"]
    with pytest.raises(FileExistsError, match="already complete"):
        ckpt.write_blob(root, 120, "late", {})

    # Load into another model, partitioned differently: [0], [1, 2, 3], [4].
    restored = make_model(1)
    for stage in ([0], [1, 2, 3], [4]):
        for index in stage:
            restored[index].load_state_dict(ckpt.read_layer(root, 120, index))
    for key, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key


def test_blobs_written_before_the_manifest_are_recorded(tmp_path):
    root = f"file://{tmp_path}/ckpt"  # URIs work like paths
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    blobs = [ckpt.write_blob(root, 7, "optim_00000", optimizer.state_dict()),
             ckpt.write_blob(root, 7, "data", {"next_step": 8, "seed": 0})]
    save_model(root, 7, model, stages=[[0, 1, 2, 3, 4]], blobs=blobs)
    assert ckpt.read_manifest(root, 7)["blobs"] == ["data", "optim_00000"]
    assert ckpt.read_blob(root, 7, "data") == {"next_step": 8, "seed": 0}
    loaded = ckpt.read_blob(root, 7, "optim_00000")
    for index, state in optimizer.state_dict()["state"].items():
        assert torch.equal(loaded["state"][index]["momentum_buffer"], state["momentum_buffer"])
    with pytest.raises(KeyError, match="no blob 'missing'; it holds \\['data', 'optim_00000'\\]"):
        ckpt.read_blob(root, 7, "missing")
    assert not [name for name in os.listdir(tmp_path / "ckpt" / "step_00000007") if name.startswith(".")]


def test_latest_ignores_incomplete_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    assert ckpt.latest_checkpoint(root) is None  # root does not exist yet
    model = make_model(0)
    save_model(root, 10, model, stages=[[0, 1, 2, 3, 4]])
    save_model(root, 20, model, stages=[[0, 1, 2, 3, 4]])
    # Step 30 crashed after two layers: no manifest.
    ckpt.write_layer(root, 30, 0, model[0].state_dict())
    ckpt.write_layer(root, 30, 1, model[1].state_dict())
    (root / "not_a_step").mkdir()
    assert ckpt.list_checkpoints(root) == [10, 20]
    assert ckpt.latest_checkpoint(root) == 20
    with pytest.raises(FileNotFoundError, match="no complete checkpoint at step 30: .*step_00000030/manifest.json"):
        ckpt.read_manifest(root, 30)
    with pytest.raises(FileNotFoundError, match="step_00000030"):
        ckpt.read_layer(root, 30, 0)

    ckpt.delete_checkpoint(root, 20)
    assert ckpt.latest_checkpoint(root) == 10
    assert not (root / "step_00000020").exists()


def test_manifest_requires_every_layer_file(tmp_path):
    root = tmp_path / "ckpt"
    model = make_model(0)
    first = ckpt.write_layer(root, 1, 0, model[0].state_dict())
    unwritten = ckpt.StoredFile("layer_00001.pt", 10, "0" * 64)
    with pytest.raises(FileNotFoundError, match="step_00000001: layer 1 file 'layer_00001.pt' is not stored"):
        ckpt.write_manifest(root, 1, {0: first, 1: unwritten}, {})
    with pytest.raises(FileNotFoundError, match="layer 0 file 'layer_00000.pt' is not stored there as written"):
        ckpt.write_manifest(root, 1, {0: first._replace(size=first.size + 1)}, {})
    with pytest.raises(ValueError, match="every global layer 0..n-1; got layers \\[0, 2\\], missing \\[1\\]"):
        ckpt.write_manifest(root, 1, {0: first, 2: unwritten._replace(name="layer_00002.pt")}, {})
    with pytest.raises(ValueError, match="layer 0 file must be the StoredFile of 'layer_00000.pt'"):
        ckpt.write_manifest(root, 1, {0: first._replace(name="weights.pt")}, {})
    with pytest.raises(ValueError, match="layer 0 file must be the StoredFile"):
        ckpt.write_manifest(root, 1, {0: "layer_00000.pt"}, {})
    with pytest.raises(TypeError, match="extra metadata .* is not JSON-serializable"):
        ckpt.write_manifest(root, 1, {0: first}, {"tensor": torch.ones(1)})
    assert ckpt.latest_checkpoint(root) is None


def test_complete_checkpoints_are_not_overwritten(tmp_path):
    root = tmp_path / "ckpt"
    model = make_model(0)
    save_model(root, 5, model, stages=[[0, 1, 2, 3, 4]])
    with pytest.raises(FileExistsError, match="step_00000005 is already complete"):
        ckpt.write_layer(root, 5, 0, {})
    ckpt.delete_checkpoint(root, 5)
    other = make_model(3)
    save_model(root, 5, other, stages=[[0, 1, 2, 3, 4]])
    assert torch.equal(ckpt.read_layer(root, 5, 0)["weight"], other[0].weight)


def test_read_errors_name_the_path(tmp_path):
    root = tmp_path / "ckpt"
    save_model(root, 3, make_model(0), stages=[[0, 1, 2, 3, 4]])
    with pytest.raises(KeyError, match="has no layer 9; it holds layers 0..4"):
        ckpt.read_layer(root, 3, 9)
    (root / "step_00000003" / "layer_00002.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="step_00000003/layer_00002.pt is damaged: 16 bytes where"):
        ckpt.read_layer(root, 3, 2)
    (root / "step_00000003" / "layer_00004.pt").unlink()
    with pytest.raises(CheckpointError, match="layer_00004.pt is listed in its manifest but missing") as error:
        ckpt.read_layer(root, 3, 4)
    assert error.value.path.endswith("step_00000003/layer_00004.pt")
    manifest = root / "step_00000003" / "manifest.json"
    manifest.write_text("{truncated")
    with pytest.raises(CheckpointError, match="step_00000003/manifest.json is not valid JSON"):
        ckpt.read_manifest(root, 3)
    manifest.write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match="is not a raypipe checkpoint manifest"):
        ckpt.read_manifest(root, 3)


@pytest.mark.parametrize("where", [0.5, -1])  # inside a tensor's bytes; the zip directory at the end
def test_a_flipped_byte_of_the_same_size_is_detected(tmp_path, where):
    root = tmp_path / "ckpt"
    save_model(root, 4, make_model(0), stages=[[0, 1, 2, 3, 4]])
    path = root / "step_00000004" / "layer_00002.pt"
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="layer_00002.pt is damaged: its SHA-256 differs") as error:
        ckpt.read_layer(root, 4, 2)
    assert error.value.path == str(path)
    assert ckpt.read_layer(root, 4, 0).keys() == {"weight", "bias"}  # the other files still load


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="step must be a non-negative int, got -1"):
        ckpt.write_layer(tmp_path, -1, 0, {})
    with pytest.raises(ValueError, match="layer_index must be a non-negative int, got 'a'"):
        ckpt.write_layer(tmp_path, 0, "a", {})
    with pytest.raises(TypeError, match="layer 0 state must be a dict"):
        ckpt.write_layer(tmp_path, 0, 0, [1, 2])
    for name in ("layer_00000", "manifest", "../escape", ""):
        with pytest.raises(ValueError, match="invalid checkpoint blob name"):
            ckpt.write_blob(tmp_path, 0, name, {})


def test_filesystem_for_paths_and_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    filesystem, path = filesystem_for("relative/dir")
    assert filesystem.type_name == "local" and path == str(Path(tmp_path, "relative/dir"))
    assert filesystem_for(f"file://{tmp_path}/x/")[1] == f"{tmp_path}/x"
