"""MoEConfig: presets, from_pretrained (dir, file, transformers config), validation errors
that name the bad value, parallel-split checks, paste-able repr."""

import json

import pytest

from dsv4_moe import MoEConfig


def test_presets_match_spec():
    f, p = MoEConfig.flash(), MoEConfig.pro()
    assert (f.hidden_size, f.moe_intermediate_size, f.n_routed_experts, f.routed_scaling_factor) == (4096, 2048, 256, 1.5)
    assert (p.hidden_size, p.moe_intermediate_size, p.n_routed_experts, p.routed_scaling_factor) == (7168, 3072, 384, 2.5)
    assert p.local_intermediate(8) == 384  # V4-Pro at TP8: 384 per rank, not padded
    assert f.is_hash_layer(2) and not f.is_hash_layer(3)


def test_repr_is_pasteable():
    c = MoEConfig.pro()
    assert eval(repr(c), {"MoEConfig": MoEConfig}) == c


def test_from_pretrained_dir_and_file(tmp_path):
    c = MoEConfig.flash()
    (tmp_path / "config.json").write_text(json.dumps(c.to_dict()))
    assert MoEConfig.from_pretrained(tmp_path) == c
    assert MoEConfig.from_pretrained(tmp_path / "config.json") == c
    with pytest.raises(FileNotFoundError, match="no config.json"):
        MoEConfig.from_pretrained(tmp_path / "nope")


def test_from_transformers_config():
    transformers = pytest.importorskip("transformers")
    hcfg = transformers.DeepseekV4Config(hidden_size=256, moe_intermediate_size=128, n_routed_experts=8,
                                         num_experts_per_tok=2, num_hidden_layers=4, num_hash_layers=2,
                                         vocab_size=64)
    c = MoEConfig.from_pretrained(hcfg)
    assert (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_hash_layers) == (256, 128, 8, 2)


def test_v41_is_rejected_by_name(tmp_path):
    d = {"model_type": "deepseek_v41", "text_config": MoEConfig.flash().to_dict()}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="V4.1.*not supported yet"):
        MoEConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("extra,match", [
    ({"gate_temp": 2.0}, "gate_temp=2.0: the router would divide its logits by it"),
    ({"bias_vl": [0.0]}, r"bias_vl=\[0.0\]: a second selection bias"),
    ({"text_config": {}}, "text_config is set"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu': expected 'silu'"),
    ({"quantization_config": {"scale_fmt": None}}, "quantization_config.scale_fmt=None: expected 'ue8m0'"),
    ({"quantization_config": {"fmt": "e5m2"}}, "quantization_config.fmt='e5m2': expected 'e4m3'"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method='mxfp4': expected 'fp8'"),
    ({"quantization_config": {"activation_scheme": "static"}}, "activation_scheme='static': expected 'dynamic'"),
])
def test_config_keys_that_change_the_numerics_are_refused(extra, match):
    """Keys the package does not implement (V4.1's gate_temp / bias_vl / text_config, another activation,
    other FP8 formats or scale formats) are refused, never loaded and ignored; V4's own values (or the
    keys absent) load (session 45's audit)."""
    d = MoEConfig.flash().to_dict()
    d.update(gate_temp=1.0, hidden_act="silu")
    assert MoEConfig.from_dict(d) == MoEConfig.flash()
    d = {**d, **{k: v for k, v in extra.items() if k != "quantization_config"}}
    if "quantization_config" in extra:
        d["quantization_config"] = {**d["quantization_config"], **extra["quantization_config"]}
    with pytest.raises(ValueError, match=match):
        MoEConfig.from_dict(d)


@pytest.mark.parametrize("kw,match", [
    ({"hidden_size": 0}, "hidden_size=0"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"expert_dtype": "fp8"}, "expert_dtype='fp8'"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok=300 exceeds"),
    ({"fp8_block_size": (32, 32)}, r"fp8_block_size=\(32, 32\)"),
    ({"moe_intermediate_size": 100}, "moe_intermediate_size=100"),
    ({"num_hash_layers": 99}, "num_hash_layers=99"),
    ({"num_hash_layers": True}, "num_hash_layers=True"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor=inf: expected a finite number"),
    ({"routed_scaling_factor": "1.5"}, "routed_scaling_factor='1.5': expected a finite number"),
    ({"swiglu_limit": True}, "swiglu_limit=True: expected a finite number"),
    ({"swiglu_limit": float("nan")}, "swiglu_limit=nan"),
    ({"n_shared_experts": True}, "n_shared_experts=True: expected 1"),
    ({"norm_topk_prob": "no"}, "norm_topk_prob='no'"),
    ({"fp8_block_size": (128.0, 128.0)}, r"fp8_block_size=\(128.0, 128.0\): expected two ints"),
    ({"fp8_block_size": 128}, "fp8_block_size=128: expected two ints"),
])
def test_validation_names_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig.flash().replace(**kw)


def test_check_parallel():
    p = MoEConfig.pro()
    p.check_parallel(tp_rank=7, tp_size=8)
    p.check_parallel(ep_rank=3, ep_size=8)
    with pytest.raises(ValueError, match="tp_rank=8"):
        p.check_parallel(tp_rank=8, tp_size=8)
    with pytest.raises(ValueError, match="ep_size=5: n_routed_experts=384"):
        p.check_parallel(ep_size=5)
    with pytest.raises(ValueError, match="per-rank intermediate 192"):
        p.check_parallel(tp_size=16)  # 3072/16 = 192: whole MXFP4 groups but not whole FP8 blocks
    with pytest.raises(ValueError, match="combine one of them"):
        p.check_parallel(tp_size=2, ep_size=2)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(hidden_size=256.9), r"hidden_size=256.9: expected an int"),
    (lambda d: d.update(n_routed_experts="8"), r"n_routed_experts='8': expected an int"),
    (lambda d: d.update(num_experts_per_tok=True), r"num_experts_per_tok=True: expected an int"),
    (lambda d: d.update(norm_topk_prob="false"), r"norm_topk_prob='false': expected true or false"),
    (lambda d: d.update(num_hash_layers=None), r"num_hash_layers=None: expected an int"),
    (lambda d: d.update(routed_scaling_factor="1.5"), r"routed_scaling_factor='1.5': expected a number"),
    (lambda d: d.pop("routed_scaling_factor"), r"missing required key 'routed_scaling_factor'"),
    (lambda d: d.pop("num_hidden_layers"), r"missing required key 'num_hidden_layers'"),
    (lambda d: d.pop("swiglu_limit"), r"missing required key 'swiglu_limit'"),
    (lambda d: d["quantization_config"].update(weight_block_size=128), r"weight_block_size=128: expected a list"),
    (lambda d: d.update(quantization_config=[1]), r"quantization_config=\[1\]: expected a JSON object"),
])
def test_config_json_values_are_not_coerced(tmp_path, edit, match):
    """A config.json value of the wrong JSON type, or a missing key that sets the numerics,
    is an error naming the file and the key - never truncated, parsed or defaulted."""
    d = MoEConfig.flash().to_dict()
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=match) as ei:
        MoEConfig.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(ei.value)


@pytest.mark.parametrize("raw,match", [(b"[1]", "expected a JSON object of config keys, got list"),
                                       (b'{"hidden_size": "\xff"}', "not valid UTF-8 JSON"),
                                       (b"{", "not valid UTF-8 JSON")])
def test_config_json_not_an_object(tmp_path, raw, match):
    (tmp_path / "config.json").write_bytes(raw)
    with pytest.raises(ValueError, match=match):
        MoEConfig.from_pretrained(tmp_path)


def test_parallel_and_layer_arguments_refuse_bools():
    c = MoEConfig.tiny()
    with pytest.raises(ValueError, match="tp_size=True"):
        c.check_parallel(tp_size=True)
    with pytest.raises(ValueError, match="ep_rank=False"):
        c.check_parallel(ep_rank=False)
    with pytest.raises(ValueError, match="layer_idx=True"):
        c.is_hash_layer(True)
    with pytest.raises(ValueError, match=r"preset=\['flash'\]"):
        MoEConfig.preset(["flash"])


def test_from_pretrained_source_type():
    for bad in (None, 123, {}):
        with pytest.raises(TypeError, match="from_pretrained: source=.*expected a checkpoint directory"):
            MoEConfig.from_pretrained(bad)
