"""write_checkpoint -> load_layer_weights round trips (SPEC §3, §6).

Every loaded byte is compared with the raw shard as safetensors reads it; TP and EP
loads are compared with slices of the full tensors; shard access is observed through
CheckpointReader.opened_files.
"""

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open

from dsv4_moe.config import MoEConfig
from dsv4_moe.weights import (CheckpointReader, layer_tensor_names, load_layer_weights, make_checkpoint_main,
                              parse_name, write_checkpoint)
from dsv4_moe.weights import reader as reader_mod
from dsv4_moe.weights.names import ParsedName
from dsv4_moe.weights.slicing import sliced_shape, tp_index

# Small, with one hash layer (0) and biased layers (1, 2); written: layers 0 and 2.
SMALL = MoEConfig(hidden_size=256, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
                  num_hidden_layers=3, num_hash_layers=1, vocab_size=64, name="test-small")
# Narrow but V4-Pro-wide intermediate: TP8 gives I = 384 per rank.
NARROW = MoEConfig(hidden_size=256, moe_intermediate_size=3072, n_routed_experts=2, num_experts_per_tok=2,
                   num_hidden_layers=1, num_hash_layers=0, vocab_size=64, name="test-narrow")


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("small"), SMALL, layers=[0, 2], seed=7)


@pytest.fixture(scope="module")
def narrow_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("narrow"), NARROW, layers=[0], seed=3)


def _raw(ckpt: str, name: str) -> torch.Tensor:
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(ckpt, shard), framework="pt") as f:
        return f.get_tensor(name).clone()


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)} != {list(want.shape)}"
    a, b = _u8(got).flatten(), _u8(want).flatten()
    diff = (a != b).nonzero()
    assert diff.numel() == 0, (f"{what}: {diff.numel()} bytes differ, first at flat {int(diff[0])}: "
                               f"{int(a[diff[0]])} vs {int(b[diff[0]])}")


# ---------------------------------------------------------------- the file format
def test_written_checkpoint_is_in_the_official_format(small_ckpt):
    with open(os.path.join(small_ckpt, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index) == {"metadata", "weight_map"}
    wm = index["weight_map"]
    expected = {s.name: s for layer in (0, 2) for s in layer_tensor_names(SMALL, layer)}
    assert set(wm) == set(expected)
    assert sorted(set(wm.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert MoEConfig.from_pretrained(small_ckpt) == SMALL
    total = 0
    for shard in sorted(set(wm.values())):
        with open(os.path.join(small_ckpt, shard), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        assert header.pop("__metadata__") == {"format": "pt"}
        for name, info in header.items():
            assert wm[name] == shard and not name.startswith("model.")
            spec = expected[name]
            assert (info["dtype"], tuple(info["shape"])) == (spec.dtype, spec.shape), name
            total += info["data_offsets"][1] - info["data_offsets"][0]
    assert index["metadata"]["total_size"] == total
    # Exact dtypes of the release: router weight BF16, bias F32, tid2eid I64, packed e2m1 I8.
    assert expected["layers.0.ffn.gate.tid2eid"].dtype == "I64"
    assert "layers.0.ffn.gate.bias" not in wm and "layers.2.ffn.gate.tid2eid" not in wm


def test_tid2eid_rows_are_distinct_expert_ids(small_ckpt):
    t = _raw(small_ckpt, "layers.0.ffn.gate.tid2eid")
    assert t.dtype == torch.int64 and t.shape == (64, 2)
    assert bool(((t >= 0) & (t < 8)).all())
    assert bool((t[:, 0] != t[:, 1]).all())


def test_writer_is_deterministic_and_independent_of_other_layers(small_ckpt, tmp_path):
    one = write_checkpoint(tmp_path / "one", SMALL, layers=[2], seed=7)
    for spec in layer_tensor_names(SMALL, 2):
        _assert_same_bytes(_raw(one, spec.name), _raw(small_ckpt, spec.name), spec.name)
    other = write_checkpoint(tmp_path / "other", SMALL, layers=[2], seed=8)
    assert not torch.equal(_u8(_raw(other, "layers.2.ffn.experts.0.w1.weight")),
                           _u8(_raw(one, "layers.2.ffn.experts.0.w1.weight")))


def test_weights_look_like_quantised_gaussians(small_ckpt):
    # ~N(0, 0.02) quantised per group: scales near 0.02*3/6 -> bytes around 2^-7..2^-6.
    from dsv4_moe.weights.formats import dequant_fp8_block, dequant_mxfp4
    w = dequant_mxfp4(_raw(small_ckpt, "layers.2.ffn.experts.3.w2.weight"),
                      _raw(small_ckpt, "layers.2.ffn.experts.3.w2.scale"))
    assert 0.017 < float(w.std()) < 0.023
    s = _raw(small_ckpt, "layers.2.ffn.shared_experts.w1.scale").view(torch.uint8)
    ws = dequant_fp8_block(_raw(small_ckpt, "layers.2.ffn.shared_experts.w1.weight"),
                           _raw(small_ckpt, "layers.2.ffn.shared_experts.w1.scale"))
    assert 0.019 < float(ws.std()) < 0.021 and s.unique().numel() <= 2


# ---------------------------------------------------------------- round trip
@pytest.mark.parametrize("layer", [0, 2])
def test_load_is_byte_identical_to_the_shards(small_ckpt, layer):
    config, w = load_layer_weights(small_ckpt, layer)
    assert config == SMALL
    i = SMALL.moe_intermediate_size
    p = f"layers.{layer}.ffn."
    _assert_same_bytes(w.router.weight, _raw(small_ckpt, p + "gate.weight"), "gate.weight")
    if layer == 0:
        assert w.router.bias is None and w.router.tid2eid.dtype == torch.int64
        _assert_same_bytes(w.router.tid2eid, _raw(small_ckpt, p + "gate.tid2eid"), "tid2eid")
    else:
        assert w.router.tid2eid is None and w.router.bias.dtype == torch.float32
        _assert_same_bytes(w.router.bias, _raw(small_ckpt, p + "gate.bias"), "bias")
    sh = w.shared
    assert sh.gate_up.dtype == torch.float8_e4m3fn and sh.gate_up_scale.dtype == torch.float8_e8m0fnu
    _assert_same_bytes(sh.gate_up[:i], _raw(small_ckpt, p + "shared_experts.w1.weight"), "shared w1")
    _assert_same_bytes(sh.gate_up[i:], _raw(small_ckpt, p + "shared_experts.w3.weight"), "shared w3")
    _assert_same_bytes(sh.gate_up_scale[:i // 128], _raw(small_ckpt, p + "shared_experts.w1.scale"), "shared w1 s")
    _assert_same_bytes(sh.gate_up_scale[i // 128:], _raw(small_ckpt, p + "shared_experts.w3.scale"), "shared w3 s")
    _assert_same_bytes(sh.down, _raw(small_ckpt, p + "shared_experts.w2.weight"), "shared w2")
    _assert_same_bytes(sh.down_scale, _raw(small_ckpt, p + "shared_experts.w2.scale"), "shared w2 s")
    r = w.routed
    assert (r.first_expert, r.num_experts, r.num_local) == (0, 8, 8)
    assert r.gate_up.dtype == torch.uint8 and r.gate_up_scale.dtype == torch.float8_e8m0fnu
    for e in range(8):
        q = f"{p}experts.{e}."
        _assert_same_bytes(r.gate_up[e, :i], _raw(small_ckpt, q + "w1.weight"), f"expert {e} w1")
        _assert_same_bytes(r.gate_up[e, i:], _raw(small_ckpt, q + "w3.weight"), f"expert {e} w3")
        _assert_same_bytes(r.gate_up_scale[e, :i], _raw(small_ckpt, q + "w1.scale"), f"expert {e} w1 s")
        _assert_same_bytes(r.gate_up_scale[e, i:], _raw(small_ckpt, q + "w3.scale"), f"expert {e} w3 s")
        _assert_same_bytes(r.down[e], _raw(small_ckpt, q + "w2.weight"), f"expert {e} w2")
        _assert_same_bytes(r.down_scale[e], _raw(small_ckpt, q + "w2.scale"), f"expert {e} w2 s")


def test_loading_layer_opens_only_its_shard(small_ckpt, monkeypatch):
    opened = []
    real_init = reader_mod.CheckpointReader.__init__

    def spy_init(self, *a, **k):
        real_init(self, *a, **k)
        opened.append(self.opened_files)  # the live list: filled as shards are opened

    monkeypatch.setattr(reader_mod.CheckpointReader, "__init__", spy_init)
    load_layer_weights(small_ckpt, 2)
    assert opened == [["model-00002-of-00002.safetensors"]]
    opened.clear()
    load_layer_weights(small_ckpt, 0)
    assert opened == [["model-00001-of-00002.safetensors"]]


def test_layer_straddling_shards_opens_exactly_its_shards(tmp_path):
    ckpt = write_checkpoint(tmp_path, SMALL, layers=[0, 2], seed=7, num_shards=3)
    with CheckpointReader(ckpt) as r:
        holders = {r.shard_of(s.name) for s in layer_tensor_names(SMALL, 2)}
        r.read([reader_mod.TensorRequest(s) for s in layer_tensor_names(SMALL, 2)])
        assert sorted(r.opened_files) == sorted(holders)
    assert len(holders) == 2  # the middle shard holds the end of layer 0 and the start of layer 2


def test_tp_slices_equal_slices_of_the_full_tensors(small_ckpt):
    _, full = load_layer_weights(small_ckpt, 2)
    i = SMALL.moe_intermediate_size
    for tp in (2,):
        n = i // tp
        for rank in range(tp):
            _, w = load_layer_weights(small_ckpt, 2, tp_rank=rank, tp_size=tp)
            rows = slice(rank * n, (rank + 1) * n)
            gu = torch.cat([full.routed.gate_up[:, :i][:, rows], full.routed.gate_up[:, i:][:, rows]], dim=1)
            _assert_same_bytes(w.routed.gate_up, gu, f"tp{tp} r{rank} gate_up")
            gus = torch.cat([full.routed.gate_up_scale[:, :i][:, rows], full.routed.gate_up_scale[:, i:][:, rows]], 1)
            _assert_same_bytes(w.routed.gate_up_scale, gus, f"tp{tp} r{rank} gate_up_scale")
            _assert_same_bytes(w.routed.down, full.routed.down[:, :, rank * n // 2:(rank + 1) * n // 2], "down")
            _assert_same_bytes(w.routed.down_scale, full.routed.down_scale[:, :, rank * n // 32:(rank + 1) * n // 32],
                               "down_scale")
            _assert_same_bytes(w.shared.gate_up, torch.cat([full.shared.gate_up[:i][rows],
                                                            full.shared.gate_up[i:][rows]]), "shared gate_up")
            b = slice(rank * n // 128, (rank + 1) * n // 128)
            _assert_same_bytes(w.shared.gate_up_scale, torch.cat([full.shared.gate_up_scale[:i // 128][b],
                                                                  full.shared.gate_up_scale[i // 128:][b]]), "sh s")
            _assert_same_bytes(w.shared.down, full.shared.down[:, rows], "shared down")
            _assert_same_bytes(w.shared.down_scale, full.shared.down_scale[:, b], "shared down_scale")
            _assert_same_bytes(w.router.weight, full.router.weight, "router replicated")


def test_ep_ranks_hold_their_experts_and_replicate_the_rest(small_ckpt):
    _, full = load_layer_weights(small_ckpt, 2)
    for rank in range(4):
        _, w = load_layer_weights(small_ckpt, 2, ep_rank=rank, ep_size=4)
        assert (w.routed.first_expert, w.routed.num_local, w.routed.num_experts) == (2 * rank, 2, 8)
        for name in ("gate_up", "gate_up_scale", "down", "down_scale"):
            _assert_same_bytes(getattr(w.routed, name), getattr(full.routed, name)[2 * rank:2 * rank + 2], name)
            _assert_same_bytes(getattr(w.shared, name), getattr(full.shared, name), "shared " + name)
        _assert_same_bytes(w.router.bias, full.router.bias, "bias")


def test_tp8_of_3072_gives_384_unpadded(narrow_ckpt):
    _, full = load_layer_weights(narrow_ckpt, 0)
    i, n = 3072, 384
    for rank in (0, 5, 7):
        _, w = load_layer_weights(narrow_ckpt, 0, tp_rank=rank, tp_size=8)
        r, s = w.routed, w.shared
        assert r.intermediate == n and s.intermediate == n
        assert r.gate_up.shape == (2, 2 * n, 128) and r.gate_up_scale.shape == (2, 2 * n, 8)
        assert r.down.shape == (2, 256, n // 2) and r.down_scale.shape == (2, 256, 12)  # 12 MXFP4 groups
        assert s.gate_up.shape == (2 * n, 256) and s.gate_up_scale.shape == (6, 2)
        assert s.down.shape == (256, n) and s.down_scale.shape == (2, 3)  # 3 FP8 blocks
        cols = slice(rank * n, (rank + 1) * n)
        _assert_same_bytes(r.down, full.routed.down[:, :, rank * 192:(rank + 1) * 192], f"r{rank} down")
        _assert_same_bytes(r.gate_up[:, n:], full.routed.gate_up[:, i:][:, cols], f"r{rank} up")
        _assert_same_bytes(s.down_scale, full.shared.down_scale[:, rank * 3:(rank + 1) * 3], f"r{rank} sh down s")


def test_pro_tp8_slice_shapes_without_data():
    pro = MoEConfig.pro()
    shapes = {s.logical: sliced_shape(s.shape, tp_index(s.logical, pro, 7, 8))
              for s in layer_tensor_names(pro, 5, experts=[383])}
    assert shapes["experts.383.w1.weight"] == (384, 3584)
    assert shapes["experts.383.w2.weight"] == (7168, 192)
    assert shapes["experts.383.w2.scale"] == (7168, 12)
    assert shapes["shared.w3.scale"] == (3, 56)
    assert shapes["shared.w2.scale"] == (56, 3)
    assert shapes["router.weight"] == (384, 7168)


def test_tp_split_that_cuts_scale_groups_is_refused(small_ckpt):
    with pytest.raises(ValueError, match="tp_size=3"):
        load_layer_weights(small_ckpt, 2, tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="ep_size=3"):
        load_layer_weights(small_ckpt, 2, ep_rank=0, ep_size=3)


def test_progress_bar_forced_on_writes_to_stderr(small_ckpt, capsys):
    load_layer_weights(small_ckpt, 2, progress=True)
    assert "layer 2 experts" in capsys.readouterr().err


def test_parse_name_is_exact():
    assert parse_name("layers.3.ffn.experts.7.w2.scale") == ParsedName(3, "experts.7.w2.scale", 7)
    assert parse_name("layers.0.ffn.gate.tid2eid") == ParsedName(0, "router.tid2eid")
    for bad in ("model.layers.3.ffn.gate.weight", "layers.3.ffn.experts.7.w2.scale_inv",
                "layers.03.ffn.gate.weight", "layers.3.attn.wq.weight", "layers.3.ffn.experts.7.w4.weight",
                "layers.3.ffn.shared_experts.w1.weight.extra"):
        assert parse_name(bad) is None, bad


def test_single_file_checkpoint_is_read(tmp_path, small_ckpt):
    from safetensors.torch import save_file
    tensors = {s.name: _raw(small_ckpt, s.name) for s in layer_tensor_names(SMALL, 2)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(SMALL.to_dict(), f)
    _, w = load_layer_weights(tmp_path, 2)
    _, ref = load_layer_weights(small_ckpt, 2)
    _assert_same_bytes(w.routed.gate_up, ref.routed.gate_up, "gate_up")


def test_make_checkpoint_cli(tmp_path):
    out = tmp_path / "cli"
    assert make_checkpoint_main(["--preset", "tiny", "--layers", "1", "--out", str(out), "--seed", "5",
                                 "--no-progress"]) == 0
    config, w = load_layer_weights(out, 1)
    assert config == MoEConfig.tiny() and w.routed.intermediate == 384
    assert make_checkpoint_main(["--preset", "tiny", "--layers", "1", "--out", str(out), "--no-progress"]) == 2


def test_writer_checks_every_argument_before_touching_disk(tmp_path, capsys):
    """A refused make-checkpoint leaves the disk as it was: --overwrite with a bad --num-shards keeps
    the old checkpoint (it used to delete it, then fail), a fresh --out is not created, and an --out
    that is a file is named as such. The shards get the mode of the process's other new files (the
    index's; safetensors writes 0600 whatever the umask)."""
    out = tmp_path / "ck"
    assert make_checkpoint_main(["--layers", "1", "--out", str(out), "--no-progress"]) == 0
    before = sorted(os.listdir(out))
    capsys.readouterr()
    assert make_checkpoint_main(["--layers", "1", "--out", str(out), "--overwrite", "--num-shards", "999",
                                 "--no-progress"]) == 2
    assert "num_shards=999" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == before
    load_layer_weights(out, 1)                      # still a whole checkpoint
    fresh = tmp_path / "fresh"
    assert make_checkpoint_main(["--layers", "1", "--out", str(fresh), "--num-shards", "0", "--no-progress"]) == 2
    assert not fresh.exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert make_checkpoint_main(["--layers", "1", "--out", str(afile), "--no-progress"]) == 2
    assert "is not a directory" in capsys.readouterr().err and afile.read_text() == "x"
    index_mode = os.stat(out / "model.safetensors.index.json").st_mode & 0o777
    shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert shards and all(os.stat(out / f).st_mode & 0o777 == index_mode for f in shards)



def test_writer_refuses_what_the_loader_would_refuse(tmp_path):
    """write_checkpoint refuses, before touching the disk, an intermediate size the loader cannot read
    back (not a multiple of the FP8 block: it wrote such checkpoints before) and a non-bool overwrite
    ('no' counted as True and replaced the checkpoint)."""
    odd = SMALL.replace(moe_intermediate_size=96)
    with pytest.raises(ValueError, match="moe_intermediate_size=96: the loader needs a multiple of 128"):
        write_checkpoint(tmp_path / "odd", odd, layers=[1])
    assert not (tmp_path / "odd").exists()
    out = tmp_path / "ck"
    write_checkpoint(out, SMALL, layers=[1], progress=False)
    before = {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)}
    for kw in ({"overwrite": "no"}, {"overwrite": 1}, {"progress": "yes"}):
        with pytest.raises(TypeError, match=f"{next(iter(kw))}="):
            write_checkpoint(out, SMALL, layers=[1], **kw)
    assert {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)} == before
