"""Config validation: every bad value raises ValueError naming the field and the value."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

import models
from models import (
    AttentionConfig,
    LatentConfig,
    LinearConfig,
    ModelConfig,
    SoftmaxConfig,
    pattern,
)
from models.heads import cached_impl

LINEAR = {"kind": "linear", "rope": False}
MLA = {"kind": "mla"}
CLASSES = {"softmax": SoftmaxConfig, "linear": LinearConfig, "mla": LatentConfig}


def layer(**kwargs):
    """The layer config of ``kwargs``'s kind (default softmax) from ``kwargs``."""
    return CLASSES.get(kwargs.get("kind", "softmax"), AttentionConfig)(**kwargs)


ATTENTION_ERRORS = [
    ({"kind": "rnn"}, "kind", "rnn"),
    ({"num_heads": 0}, "num_heads", 0),
    ({"num_kv_heads": 3}, "num_kv_heads", 3),
    ({"num_kv_heads": 0}, "num_kv_heads", 0),
    ({"head_dim": 0}, "head_dim", 0),
    ({"head_dim": 7}, "head_dim", 7),  # RoPE rotates pairs
    ({"rotary_dim": 3}, "rotary_dim", 3),
    ({"rotary_dim": 16}, "rotary_dim", 16),
    ({"rope": 1}, "rope", 1),
    ({"rope_base": -1.0}, "rope_base", -1.0),
    ({"short_conv": -1}, "short_conv", -1),
    ({"short_conv": 2.0}, "short_conv", 2.0),
    ({**LINEAR, "short_conv": True}, "short_conv", True),
    ({"window": 0}, "window", 0),
    ({"radius": -1}, "radius", -1),
    ({"radius": 2.0}, "radius", 2.0),
    ({"window": 4, "radius": 2}, "radius", 2),  # one is causal, the other bidirectional
    ({"initial_tokens": 2}, "initial_tokens", 2),  # without a window
    ({"window": 4, "initial_tokens": -1}, "initial_tokens", -1),
    ({"window": 4, "initial_tokens": 1.5}, "initial_tokens", 1.5),
    ({"global_tokens": (1,)}, "global_tokens", (1,)),  # without a window
    ({"window": 4, "global_tokens": (-1,)}, "global_tokens", (-1,)),
    ({"window": 4, "global_tokens": [0]}, "global_tokens", [0]),
    ({"impl": "flash"}, "impl", "flash"),
    ({"impl": "xla", "window": 4, "initial_tokens": 2}, "impl", "xla"),
    ({"softcap": 0.0}, "softcap", 0.0),
    ({"sink_logits": "yes"}, "sink_logits", "yes"),
    ({**LINEAR, "feature_map": "cos"}, "feature_map", "cos"),
    ({**LINEAR, "form": "fast"}, "form", "fast"),
    ({**LINEAR, "chunk_size": 0}, "chunk_size", 0),
    ({**LINEAR, "decay": 1.5}, "decay", 1.5),
    ({**LINEAR, "decay": (0.9,)}, "decay", (0.9,)),
    ({**LINEAR, "decay": "fast"}, "decay", "fast"),
    ({**LINEAR, "gating": 1}, "gating", 1),
    ({**LINEAR, "normalize": "no"}, "normalize", "no"),
    ({**LINEAR, "feature_map": "favor"}, "num_features", None),
    ({**LINEAR, "num_features": 0}, "num_features", 0),
    ({**MLA, "kv_rank": 0}, "kv_rank", 0),
    ({**MLA, "q_rank": 0}, "q_rank", 0),
    ({"qk_norm": 1}, "qk_norm", 1),
    ({**MLA, "rope_head_dim": 3}, "rope_head_dim", 3),
    ({**MLA, "num_kv_heads": 2}, "num_kv_heads", 2),
    ({**MLA, "nope_head_dim": 0}, "nope_head_dim", 0),
    ({**MLA, "v_head_dim": -2}, "v_head_dim", -2),
]
# A field another kind reads is not a field of this kind's config class.
FOREIGN_FIELDS = [
    {"feature_map": "cos"},
    {"form": "fast"},
    {"chunk_size": 0},
    {"decay": "retnet"},  # softmax has no decay
    {"gating": True},
    {**LINEAR, "radius": 2},
    {**LINEAR, "window": 4},
    {**LINEAR, "softcap": 5.0},
    {**LINEAR, "sink_logits": True},
    {**MLA, "rotary_dim": 4},
    {**MLA, "score": "alibi"},
]


@pytest.mark.parametrize(("kwargs", "field", "value"), ATTENTION_ERRORS)
def test_attention_config_errors(kwargs, field, value):
    with pytest.raises(ValueError, match=field) as err:
        layer(**kwargs)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize("kwargs", FOREIGN_FIELDS)
def test_a_field_the_kind_does_not_read_is_refused_by_name(kwargs):
    field = next(k for k in kwargs if k not in ("kind", "rope"))
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{field}'"):
        layer(**kwargs)


def test_one_config_class_per_kind():
    for name, cls in CLASSES.items():
        assert models.KINDS[name].config_class is cls
    assert models.KINDS["linear"].fields == (
        "rotary_dim",
        *("feature_map", "form", "decay", "gating", "chunk_size", "normalize", "num_features"),
    )
    with pytest.raises(ValueError, match="kind 'linear' is configured by LinearConfig"):
        AttentionConfig(kind="linear")
    with pytest.raises(ValueError, match="kind 'linear' is configured by LinearConfig"):
        SoftmaxConfig(kind="linear")


def test_initial_tokens_messages_name_the_field():
    with pytest.raises(ValueError, match=r"^initial_tokens: expected a non-negative int, got -1$"):
        SoftmaxConfig(window=4, initial_tokens=-1)
    with pytest.raises(ValueError, match=r"^initial_tokens: expected 0 without a window"):
        SoftmaxConfig(initial_tokens=2)
    with pytest.raises(ValueError, match="initial tokens"):
        SoftmaxConfig(impl="xla", window=4, initial_tokens=2)
    with pytest.raises(TypeError, match="sinks"):  # renamed without an alias
        SoftmaxConfig(window=4, sinks=2)


MODEL_ERRORS = [
    ({"vocab_size": 0}, "vocab_size", 0),
    ({"width": -1}, "width", -1),
    ({"mlp_width": 0}, "mlp_width", 0),
    ({"layers": ()}, "layers", ()),
    ({"layers": ("mha",)}, "layers", ("mha",)),
    ({"norm_eps": 0.0}, "norm_eps", 0.0),
    ({"tied_embeddings": 1}, "tied_embeddings", 1),
    ({"dtype": "int32"}, "dtype", "int32"),
    ({"param_dtype": "nope"}, "param_dtype", "nope"),
    ({"encoder_layers": "mha"}, "encoder_layers", "mha"),
    ({"cross_attention": LatentConfig()}, "cross_attention", "kind='mla'"),
    ({"cross_attention": SoftmaxConfig()}, "cross_attention", "rope=True"),
    ({"cross_attention": SoftmaxConfig(rope=False, radius=2)}, "cross_attention", "radius=2"),
    ({"cross_attention": SoftmaxConfig(rope=False, short_conv=4)}, "cross_attention", "conv=4"),
    ({"encoder_layers": pattern(("window",))}, "encoder_layers", "encoder_layers[0].window"),
]


@pytest.mark.parametrize(("kwargs", "field", "value"), MODEL_ERRORS)
def test_model_config_errors(kwargs, field, value):
    with pytest.raises(ValueError, match=field) as err:
        ModelConfig(**kwargs)
    assert (value if isinstance(value, str) else repr(value)) in str(err.value)


def test_pattern_and_presets():
    layers = pattern(("window", "window", "mha") * 4)
    assert len(layers) == 12 and layers[2] == models.presets()["mha"]
    assert layers[0].window == 4 and layers[2].window is None
    hybrid = pattern(("linear", "linear", "mha") * 2)
    assert [a.kind for a in hybrid] == ["linear", "linear", "softmax"] * 2
    big = models.presets(num_heads=8, head_dim=32, gqa_kv_heads=2, window=128)
    assert big["gqa"].num_kv_heads == 2 and big["streaming"].window == 128
    assert big["linear_decay"].decay_values()[0] == 1 - 2**-5
    config = ModelConfig(layers=pattern(("mla", "streaming", "linear_decay")))
    assert hash(config) == hash(dataclasses.replace(config))  # hashable: static under jit
    assert config.hidden_width == 4 * config.width
    with pytest.raises(ValueError, match="names") as err:
        pattern(("mha", "flash"))
    assert "'flash'" in str(err.value)
    with pytest.raises(ValueError, match="names"):
        pattern("mha")


def test_based_presets():
    """Based: Taylor linear attention of head dim 16 and a small softmax window, each with a
    short convolution of width 4 on its input."""
    based, window = models.presets()["based"], models.presets()["based_window"]
    assert (based.kind, based.feature_map, based.head_dim, based.short_conv) == (
        "linear",
        "taylor",
        16,
        4,
    )
    assert not based.rope and based.decay is None and not based.gating
    assert (window.kind, window.window, window.short_conv) == ("softmax", 4, 4)
    custom = models.presets(window=64, short_conv=3, based_head_dim=8)
    assert custom["based"].head_dim == 8 and custom["based_window"].window == 64
    assert {custom["based"].short_conv, custom["based_window"].short_conv} == {3}
    assert all(models.presets()[n].short_conv == 0 for n in ("mha", "linear", "mla", "streaming"))


def test_the_one_presets_object():
    assert set(models.PRESET_REGISTRY) <= set(models.presets())
    assert not hasattr(models, "PRESETS")


def test_presets_is_a_public_mapping_at_one_presetsizes():
    sized = models.presets(num_heads=3)
    assert type(sized) is models.Presets and sized.sizes == models.PresetSizes(num_heads=3)
    assert repr(sized) == f"Presets({models.PresetSizes(num_heads=3)!r})"
    assert models.Presets(models.PresetSizes())["mha"] == models.presets()["mha"]
    # Every error a user meets names public things only.
    errors = []
    for bad in (
        lambda: sized["gqa"],  # 2 kv heads do not divide 3 heads
        lambda: sized["flash"],
        lambda: sized[3],
        lambda: pattern(("mha",), registry=5),
        lambda: pattern(("flash",), registry=sized),
        lambda: models.presets(heads=4),
        lambda: models.Presets({"num_heads": 4}),
    ):
        with pytest.raises((KeyError, ValueError)) as e:
            bad()
        errors.append(str(e.value))
    assert "building preset 'gqa' at PresetSizes(num_heads=3" in errors[0]
    assert errors[3].startswith("registry: expected a mapping")
    assert not [m for m in errors if "_Sized" in m or "patterns._" in m], errors


def test_masks_and_cache_layouts():
    w = models.presets()["streaming"]
    assert w.cache_layout(100) == (w.initial_tokens + w.window, w.initial_tokens)
    assert w.cache_layout(4) == (4, 0)  # shorter than the ring: a plain full cache
    assert models.presets()["global_tokens"].cache_layout(100) == (100, 0)
    assert models.presets()["mha"].cache_layout(100) == (100, 0)

    def allowed(mask, q, k):
        return bool(mask.allowed(np.array([q]), np.array([k]))[0, 0])

    band = dataclasses.replace(models.presets()["band"], initial_tokens=2)
    assert band.radius == w.window and band.window is None
    enc = band.mask(causal=False)
    assert allowed(enc, 0, 3) and not allowed(enc, 0, 9)  # a two-sided band
    assert allowed(enc, 9, 1)  # an initial token
    dec = w.mask(causal=True)
    assert not allowed(dec, 0, 3) and allowed(dec, 9, 1)
    # window is a causal span, radius a bidirectional one: each refuses the other direction.
    with pytest.raises(ValueError, match=r"^layer\.window: expected None in a bidirectional"):
        w.mask(causal=False)
    with pytest.raises(ValueError, match=r"^layer\.radius: expected None in a causal layer"):
        band.mask(causal=True)
    assert (
        models.presets()["band_global_tokens"]
        .mask(causal=False)
        .allowed(np.array([9]), np.array([0]))[0, 0]
    )


def test_model_errors():
    with pytest.raises(ValueError, match="config"):
        models.Decoder("mha", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="encoder_layers"):
        models.EncoderDecoder(ModelConfig(), rngs=nnx.Rngs(0))


def test_layers_accept_any_sequence_and_are_stored_as_a_tuple():
    layers = [models.presets()["mha"], models.presets()["linear"]]
    config = models.ModelConfig(layers=layers)
    assert config.layers == tuple(layers) and isinstance(config.layers, tuple)
    assert hash(config) == hash(models.ModelConfig(layers=tuple(layers)))
    with pytest.raises(ValueError, match="layers: expected a sequence of layer configs"):
        models.ModelConfig(layers=["mha"])


def test_cached_calls_leave_kernels_that_need_static_positions_to_auto():
    assert [cached_impl(i) for i in ("xla", "cudnn", "splash")] == ["auto"] * 3
    assert [cached_impl(i) for i in ("dense", "blockwise", "pallas")] == [
        "dense",
        "blockwise",
        "pallas",
    ]


def test_score_modifiers_are_a_softmax_field_checked_by_name():
    assert SoftmaxConfig(score="alibi").score == "alibi"
    assert models.presets()["fox"].score == "forgetting" and not models.presets()["fox"].rope
    with pytest.raises(ValueError, match=r"^score: expected one of \('alibi', 't5', 'forgetting'"):
        SoftmaxConfig(score="rope")
    with pytest.raises(ValueError, match=r"^impl: expected not 'ring' with score='forgetting'"):
        SoftmaxConfig(score="forgetting", impl="ring")
    with pytest.raises(TypeError, match="'score'"):  # an MLA layer has no score field
        dataclasses.replace(models.presets()["mla"], score="alibi")
    with pytest.raises(ValueError, match=r"^cross\.score: expected None for cross-attention"):
        models.CrossAttention(
            SoftmaxConfig(score="t5"), 16, dtype=np.float32, param_dtype=np.float32,
            rngs=nnx.Rngs(0),
        )  # fmt: skip
