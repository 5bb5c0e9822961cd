"""The committed embedded default checkpoint (weights/default/) is exactly what
scripts/make_default_checkpoint.py writes, and it loads."""

import filecmp
import importlib.util
import os

from dsv4_moe.config import MoEConfig
from dsv4_moe.weights import load_layer_weights
from dsv4_moe.weights.default import DEFAULT_CHECKPOINT_DIR

_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "make_default_checkpoint.py")


def _checkpoint_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith((".json", ".safetensors")))


def test_default_checkpoint_is_what_the_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_default_checkpoint", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.make_default_checkpoint(str(tmp_path))
    committed = _checkpoint_files(DEFAULT_CHECKPOINT_DIR)
    assert committed == _checkpoint_files(out) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    same, differ, errors = filecmp.cmpfiles(DEFAULT_CHECKPOINT_DIR, out, committed, shallow=False)
    assert differ == [] and errors == [] and sorted(same) == committed, (
        f"{differ + errors} differ from a fresh run: regenerate with scripts/make_default_checkpoint.py")


def test_default_checkpoint_loads_both_layers():
    config, w0 = load_layer_weights(DEFAULT_CHECKPOINT_DIR, 0)
    assert config == MoEConfig.tiny()
    assert w0.router.is_hash and w0.router.tid2eid.shape == (1024, 6)
    _, w1 = load_layer_weights(DEFAULT_CHECKPOINT_DIR, 1)
    assert not w1.router.is_hash and w1.router.bias.shape == (16,)
    assert w1.routed.gate_up.shape == (16, 768, 128) and w1.shared.down.shape == (256, 384)
