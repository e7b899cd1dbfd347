"""QuantSpec validation, serialisation, description; the preset registry."""

from __future__ import annotations

import pytest

from kveval.quant import QuantSpec, preset, preset_names
from kveval.quant.presets import describe_presets


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(format="int5"), "QuantSpec.format must be one of"),
        (dict(bits=0), "bits must be in 1..8"),
        (dict(bits=9), "bits must be in 1..8"),
        (dict(bits=1), "bits=1 requires mapping='asymmetric'"),
        (dict(bits=4.0), "bits must be an integer"),
        (dict(format="fp8_e4m3", bits=4), "bits must be 8 for format 'fp8_e4m3'"),
        (dict(format="fp8_e5m2", mapping="asymmetric"), "mapping must be 'symmetric'"),
        (dict(mapping="affine"), "QuantSpec.mapping must be one of"),
        (dict(granularity="block"), "QuantSpec.granularity must be one of"),
        (dict(granularity="group"), "group_size must be a positive integer"),
        (dict(granularity="group", group_size=0), "group_size must be a positive integer"),
        (dict(granularity="token", group_size=32), "group_size is only allowed with granularity 'group'"),
        (dict(scale_dtype="float8"), "QuantSpec.scale_dtype must be one of"),
        (dict(zero_point="uint8"), "QuantSpec.zero_point must be one of"),
        (dict(clip_ratio=0.0), r"clip_ratio must be in \(0, 1\]"),
        (dict(clip_ratio=1.5), r"clip_ratio must be in \(0, 1\]"),
        (dict(static_scale=1.0), "static_scale needs granularity 'tensor' or 'head'"),
        (dict(static_scale=-1.0, granularity="tensor"), "static_scale must be a positive finite number"),
        (dict(static_scale=1.0, granularity="tensor", clip_ratio=0.5), "clip_ratio must be 1.0 with a static_scale"),
        (dict(ggml="q3_k"), "QuantSpec.ggml must be one of"),
        (dict(ggml="q4_0"), r"ggml='q4_0' requires bits=4, granularity='group', group_size=32"),
        (dict(ggml="q4_1", bits=4, granularity="group", group_size=32), "requires mapping='asymmetric'"),
    ],
)
def test_invalid_specs_raise_one_clear_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        QuantSpec(**kwargs)
    assert "\n" not in str(err.value)


def test_none_ignores_other_fields_and_defaults():
    assert QuantSpec(format="none", bits=99, granularity="group").is_none
    spec = QuantSpec()
    assert (spec.format, spec.bits, spec.mapping, spec.granularity, spec.scale_dtype) == (
        "int", 8, "symmetric", "token", "float16")
    assert not spec.is_none


def test_dict_round_trip_and_unknown_key():
    spec = QuantSpec(bits=4, mapping="asymmetric", granularity="group", group_size=64)
    assert QuantSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["group_size"] == 64
    with pytest.raises(ValueError, match="unknown QuantSpec key 'group_szie'; did you mean 'group_size'"):
        QuantSpec.from_dict({"bits": 4, "group_szie": 64})


def test_check_head_dim():
    QuantSpec(granularity="group", group_size=32).check_head_dim(64)
    QuantSpec().check_head_dim(48)
    with pytest.raises(ValueError, match="^group_size 48 does not divide head_dim 64$"):
        QuantSpec(granularity="group", group_size=48).check_head_dim(64)


def test_describe():
    assert preset("int4_g64").describe() == "int4 asym g64 (fp16 scales)"
    assert preset("int8").describe() == "int8 sym token (fp16 scales)"
    assert preset("q4_0").describe() == "q4_0 (ggml, g32, fp16 scales)"
    assert preset("none").describe() == "none (full precision)"
    assert QuantSpec(bits=3, mapping="asymmetric", zero_point="int", clip_ratio=0.9,
                     scale_dtype="bfloat16").describe() == "int3 asym token int-zp clip 0.9 (bf16 scales)"


def test_presets_registry():
    names = preset_names()
    for required in ["none", "int8", "int4_g32", "int4_g64", "int4_g128", "int4_g32_sym", "int4_g64_sym",
                     "int4_g128_sym", "int3_g64", "int2_g32", "int4_token", "int2_channel", "int4_channel",
                     "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_token", "int8_tensor", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]:
        assert required in names
    desc = describe_presets()
    assert set(desc) == set(names) and all(d and "\n" not in d for d in desc.values())
    g64 = preset("int4_g64")
    assert (g64.bits, g64.mapping, g64.group_size, g64.zero_point, g64.scale_dtype) == (
        4, "asymmetric", 64, "float", "float16")
    assert preset("fp8_e4m3").static_scale == 1.0 and preset("fp8_e4m3").granularity == "tensor"
    assert preset("q5_1").bits == 5 and preset("q5_1").mapping == "asymmetric"


def test_unknown_preset_suggests():
    with pytest.raises(ValueError, match=r"unknown quantization preset 'int4_g46'; did you mean 'int4_g64'\? "
                                         r"\(kveval ls lists them\)"):
        preset("int4_g46")
