"""Broken checkpoints fail loudly, naming the tensor and the shard (or index) file, and
return nothing half-loaded."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4_moe.config import MoEConfig
from dsv4_moe.weights import CheckpointError, CheckpointReader, layer_tensor_names, load_layer_weights, write_checkpoint
from dsv4_moe.weights.reader import TensorRequest

CFG = MoEConfig(hidden_size=256, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
                num_hidden_layers=2, num_hash_layers=1, vocab_size=64, name="test-bad")
SHARD1 = "model-00002-of-00002.safetensors"  # holds layer 1


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("good"), CFG, layers=[0, 1], seed=11)


@pytest.fixture
def ckpt(good, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(good, d)
    return str(d)


def _edit_shard(ckpt, shard, fn):
    path = os.path.join(ckpt, shard)
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_json(ckpt, fname, fn):
    path = os.path.join(ckpt, fname)
    with open(path) as f:
        d = json.load(f)
    fn(d)
    with open(path, "w") as f:
        json.dump(d, f)


def _load_fails(ckpt, layer, *fragments):
    with pytest.raises(CheckpointError) as ei:
        load_layer_weights(ckpt, layer)
    msg = str(ei.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in error: {msg}"
    return msg


def test_good_checkpoint_loads(good):
    """The control: the unedited copy loads, with its config and the shard's bytes (the edits
    below are the only difference between it and each broken one)."""
    for layer in (0, 1):
        config, w = load_layer_weights(good, layer)
        assert config == CFG and w.layer_idx == layer
        p = f"layers.{layer}.ffn."
        shard = load_file(os.path.join(good, SHARD1 if layer == 1 else "model-00001-of-00002.safetensors"))
        assert torch.equal(w.router.weight.view(torch.int16), shard[p + "gate.weight"].view(torch.int16))
        assert torch.equal(w.shared.down.view(torch.uint8), shard[p + "shared_experts.w2.weight"].view(torch.uint8))
        assert torch.equal(w.routed.down[3].view(torch.uint8), shard[p + "experts.3.w2.weight"].view(torch.uint8))
        assert (w.router.tid2eid is not None) == (layer == 0)


def test_tensor_missing_from_shard(ckpt):
    name = "layers.1.ffn.experts.5.w3.scale"
    _edit_shard(ckpt, SHARD1, lambda t: t.pop(name))
    _load_fails(ckpt, 1, name, SHARD1, "missing")


def test_tensor_missing_from_index_and_shard(ckpt):
    name = "layers.1.ffn.shared_experts.w2.weight"
    _edit_shard(ckpt, SHARD1, lambda t: t.pop(name))
    _edit_json(ckpt, "model.safetensors.index.json", lambda d: d["weight_map"].pop(name))
    _load_fails(ckpt, 1, name, "model.safetensors.index.json", "missing", SHARD1)


def test_wrong_shape(ckpt):
    name = "layers.1.ffn.experts.7.w2.scale"
    _edit_shard(ckpt, SHARD1, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    _load_fails(ckpt, 1, name, SHARD1, "shape [256, 7], expected [256, 8]")


def test_wrong_dtype(ckpt):
    name = "layers.1.ffn.gate.bias"
    _edit_shard(ckpt, SHARD1, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    _load_fails(ckpt, 1, name, SHARD1, "dtype BF16, expected F32")


def test_packed_weights_stored_as_uint8_are_rejected(ckpt):
    # The release stores packed e2m1 as I8; a U8 tensor means a different writer.
    name = "layers.1.ffn.experts.0.w1.weight"
    _edit_shard(ckpt, SHARD1, lambda t: t.update({name: t[name].view(torch.uint8)}))
    _load_fails(ckpt, 1, name, SHARD1, "dtype U8, expected I8")


def test_truncated_shard(ckpt):
    path = os.path.join(ckpt, SHARD1)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    _load_fails(ckpt, 1, SHARD1, "truncated or corrupt", "layers.1.ffn.gate.weight")
    # The other layer's shard is fine and still loads.
    load_layer_weights(ckpt, 0)


def test_corrupt_header(ckpt):
    path = os.path.join(ckpt, SHARD1)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"#")
    _load_fails(ckpt, 1, SHARD1, "truncated or corrupt")


def test_index_names_a_missing_file(ckpt):
    name = "layers.1.ffn.experts.2.w1.weight"
    _edit_json(ckpt, "model.safetensors.index.json",
               lambda d: d["weight_map"].update({name: "model-00009-of-00009.safetensors"}))
    _load_fails(ckpt, 1, name, "model-00009-of-00009.safetensors", "does not exist")


def test_index_naming_a_path_outside_the_checkpoint_is_refused(ckpt):
    _edit_json(ckpt, "model.safetensors.index.json",
               lambda d: d["weight_map"].update({"layers.1.ffn.gate.weight": "../elsewhere.safetensors"}))
    with pytest.raises(CheckpointError, match="layers.1.ffn.gate.weight"):
        CheckpointReader(ckpt)


def test_config_has_more_experts_than_the_file(ckpt):
    _edit_json(ckpt, "config.json", lambda d: d.update(n_routed_experts=16))
    # Found from the index alone, before any shard is opened; the error says where the
    # layer's other tensors are.
    _load_fails(ckpt, 1, "layers.1.ffn.experts.8.w1.weight", "missing", SHARD1, "n_routed_experts=16")


def test_config_has_fewer_experts_than_the_file(ckpt):
    _edit_json(ckpt, "config.json", lambda d: d.update(n_routed_experts=4, num_experts_per_tok=2))
    _load_fails(ckpt, 1, "layers.1.ffn.experts.4.", SHARD1, "n_routed_experts=4")


def test_config_hidden_differs(ckpt):
    _edit_json(ckpt, "config.json", lambda d: d.update(hidden_size=512))
    _load_fails(ckpt, 1, "layers.1.ffn.gate.weight", SHARD1, "shape [8, 256], expected [8, 512]")


def test_config_hash_layers_disagree(ckpt):
    _edit_json(ckpt, "config.json", lambda d: d.update(num_hash_layers=0))
    _load_fails(ckpt, 0, "layers.0.ffn.gate.tid2eid", "model-00001-of-00002.safetensors", "num_hash_layers=0")
    _edit_json(ckpt, "config.json", lambda d: d.update(num_hash_layers=2))
    _load_fails(ckpt, 1, "layers.1.ffn.gate.bias", SHARD1, "num_hash_layers=2")


def test_layer_not_in_checkpoint(ckpt):
    _edit_json(ckpt, "config.json", lambda d: d.update(num_hidden_layers=3))
    _load_fails(ckpt, 2, "layers.2.ffn.", "missing")


def test_nothing_is_read_before_every_tensor_is_checked(ckpt):
    # The last expert is broken: the reader must fail in its check pass, before reading
    # (and reporting) a single tensor.
    name = "layers.1.ffn.experts.7.w2.weight"
    _edit_shard(ckpt, SHARD1, lambda t: t.update({name: t[name][:-1].contiguous()}))
    read = []
    with CheckpointReader(ckpt) as r, pytest.raises(CheckpointError, match=name):
        r.read([TensorRequest(s) for s in layer_tensor_names(CFG, 1)], on_tensor=read.append)
    assert read == []


def test_out_of_range_slice_is_refused(good):
    spec = layer_tensor_names(CFG, 1)[0]  # gate.weight [8, 256]
    with CheckpointReader(good) as r, pytest.raises(CheckpointError, match="outside shape"):
        r.read([TensorRequest(spec, (slice(4, 12), slice(None)))])


def test_missing_checkpoint_files(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("name,layer,edit,what", [
    ("layers.1.ffn.experts.1.w2.scale", 1, lambda t: t.view(torch.uint8).fill_(0xFF), "NaN e8m0 scales"),
    ("layers.1.ffn.shared_experts.w1.scale", 1, lambda t: t.view(torch.uint8)[0, 0].fill_(0xFF), "NaN e8m0 scales"),
    ("layers.1.ffn.shared_experts.w1.weight", 1, lambda t: t.view(torch.uint8)[0, 3].fill_(0x7F), "NaN FP8 e4m3"),
    ("layers.1.ffn.gate.bias", 1, lambda t: t.__setitem__(2, float("nan")), "non-finite values"),
    ("layers.1.ffn.gate.weight", 1, lambda t: t.__setitem__((0, 0), float("inf")), "non-finite values"),
    ("layers.0.ffn.gate.tid2eid", 0, lambda t: t.__setitem__((5, 1), 8), "expert ids outside [0, 8)"),
    ("layers.0.ffn.gate.tid2eid", 0, lambda t: t.__setitem__((5, 1), -1), "expert ids outside [0, 8)"),
    ("layers.0.ffn.gate.tid2eid", 0, lambda t: t.__setitem__((7, 1), int(t[7, 0])), "repeated expert ids"),
])
def test_corrupt_values_name_tensor_and_shard(ckpt, name, layer, edit, what):
    """Values a well-formed header cannot vouch for: NaN scales or FP8 codes, non-finite router
    tensors, hash-table ids outside [0, E) or repeated in a row."""
    shard = SHARD1 if layer == 1 else "model-00001-of-00002.safetensors"
    _edit_shard(ckpt, shard, lambda ts: edit(ts[name]))
    _load_fails(ckpt, layer, name, shard, what)


def test_index_not_utf8_or_with_a_duplicated_key(ckpt):
    path = os.path.join(ckpt, "model.safetensors.index.json")
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(b'{"weight_map": {"\xff\xfe": 1}}')
    _load_fails(ckpt, 1, "model.safetensors.index.json", "not valid UTF-8 JSON")
    name = '"layers.1.ffn.gate.weight": "' + SHARD1 + '"'
    with open(path, "wb") as f:
        f.write(raw.replace(name.encode(), (name + ", " + name).encode(), 1))
    _load_fails(ckpt, 1, "model.safetensors.index.json", "'layers.1.ffn.gate.weight' appears more than once")


def test_a_second_copy_in_an_opened_shard(tmp_path):
    """Layer 1 spread over two shards: a copy of one of its tensors in the shard the index does
    not map it to is named, with both shards."""
    d = write_checkpoint(tmp_path / "c", CFG, layers=[0, 1], seed=11, num_shards=3)
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    shards = sorted({s for n, s in wm.items() if n.startswith("layers.1.")})
    assert len(shards) == 2
    name = next(n for n, s in wm.items() if n.startswith("layers.1.") and s == shards[1])
    copy = load_file(os.path.join(d, shards[1]))[name]
    _edit_shard(d, shards[0], lambda ts: ts.__setitem__(name, copy))
    _load_fails(d, 1, name, shards[0], shards[1], "duplicated")
