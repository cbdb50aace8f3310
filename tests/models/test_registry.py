"""The registries: kinds, presets, feature maps and variants, added once and read at call time."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
import models
from attn.registry import Registry
from models import AttentionConfig, ModelConfig
from train import cli
from train.config import from_json, to_json


def test_registry_refuses_a_second_entry_from_elsewhere_naming_both():
    reg = Registry("widget", "widget")

    def first():
        pass

    def second():
        pass

    reg.add("a", first)
    reg.add("a", first)  # the same definition again (a re-import): replaced, not refused
    with pytest.raises(
        ValueError, match=r"^widget: 'a' is already a widget, defined by .*first.*second"
    ):
        reg.add("a", second)
    assert reg["a"] is first and list(reg) == ["a"] and "a" in reg
    with pytest.raises(ValueError, match=r"^widget: expected a widget from \['a'\], got 'b'"):
        reg.lookup("b")
    with pytest.raises(ValueError, match=r"^widget name:"):
        reg.add(" b", first)
    assert reg.remove("a") is first and "a" not in reg


def test_builtin_kinds_are_registered_like_any_other():
    want = ["comba", "delta", "diff", "dsa", "lightning", "linear", "log_linear_gated_deltanet",
            "log_linear_mamba2", "mamba2", "mesanet", "mla", "moba", "nsa", "path", "rwkv7",
            "sigmoid", "softmax", "softpick", "titans", "ttt_linear", "ttt_mlp"]  # fmt: skip
    assert sorted(models.KINDS) == want
    assert (
        models.KINDS["moba"].family == "sparse" and models.KINDS["dsa"].config is models.DSAConfig
    )
    assert models.KINDS.origin("sigmoid") == "attn.functions.attention_kind(sigmoid_attention)"
    assert models.KINDS["delta"].config is models.DeltaConfig
    assert models.KINDS["delta"].family == "linear"
    assert models.KINDS["softmax"].module is models.SelfAttention
    assert models.KINDS["linear"].family == "linear" and models.KINDS["mla"].family == "softmax"
    assert models.KINDS.origin("mla") == "models.latent.LatentAttention"
    # Two kinds of one module and config; TTT's state admits no sequence split, and says why.
    assert models.KINDS["ttt_mlp"].config is models.KINDS["ttt_linear"].config is models.TTTConfig
    assert "no transition" in models.KINDS["ttt_linear"].sequence_parallel


def test_delta_config_refuses_what_its_layer_cannot_take():
    cases = [
        (dict(gate="vector"), "gate"),
        (dict(form="parallel"), "form"),
        (dict(rope=True), "rope"),
        (dict(num_kv_heads=2), "num_kv_heads"),
        (dict(value_heads=6), "value_heads"),
        (dict(qkv_conv=-1), "qkv_conv"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=rf"^{field}: expected"):
            models.DeltaConfig(**kwargs)
    with pytest.raises(TypeError, match="'window'"):  # a softmax field
        models.DeltaConfig(window=4)
    with pytest.raises(ValueError, match=r"^kind: expected a kind whose config class"):
        models.SoftmaxConfig(kind="delta", rope=False)
    layer = models.presets()["kda"]
    assert isinstance(layer, models.DeltaConfig) and layer.gate == "channel"
    assert models.DeltaConfig(value_heads=8).num_value_heads == 8


def test_the_trained_memories_configs_refuse_what_their_layers_cannot_take():
    cases = [
        (models.TTTConfig, dict(form="chunkwise"), "form"),
        (models.TTTConfig, dict(head_dim=7), "head_dim"),  # RoPE's pairs
        (models.TTTConfig, dict(mini_batch=0), "mini_batch"),
        (models.TTTConfig, dict(num_kv_heads=2), "num_kv_heads"),
        (models.TitansConfig, dict(memory="deep"), "memory"),
        (models.TitansConfig, dict(rope=True), "rope"),
        (models.MesaConfig, dict(cg_steps=0), "cg_steps"),
        (models.MesaConfig, dict(lambda_floor=1.5), "lambda_floor"),  # above lambda's init
    ]
    for cls, kwargs, field in cases:
        with pytest.raises(ValueError, match=rf"^{field}: expected"):
            cls(**kwargs)
    assert models.MesaConfig(cg_steps=None).cg_steps is None  # the exact solve
    assert models.TTTConfig(kind="ttt_mlp", head_dim=7, rope=False).mlp


def test_a_field_of_another_kind_is_refused_not_ignored():
    with pytest.raises(TypeError, match="'feature_map'"):
        models.SoftmaxConfig(feature_map="taylor")
    with pytest.raises(TypeError, match="'window'"):
        models.LinearConfig(rope=False, window=4)
    with pytest.raises(TypeError, match="'kv_rank'"):
        models.SoftmaxConfig(kv_rank=32)
    with pytest.raises(TypeError, match="'rotary_dim'"):
        models.LatentConfig(rotary_dim=4)
    with pytest.raises(ValueError, match=r"^kind: expected a layer kind from \["):
        AttentionConfig(kind="alibi")


class _Doubled(models.SelfAttention):
    """Softmax attention times a config factor: a kind with a field of its own."""

    def __call__(self, x, **kwargs):
        return super().__call__(x, **kwargs) * self.cfg.factor

    def extend(self, x, cache, start, lengths=None):
        y, cache = super().extend(x, cache, start, lengths)
        return y * self.cfg.factor, cache


@dataclasses.dataclass(frozen=True)
class _FactorConfig(models.SoftmaxConfig):
    kind: str = "test_factor"
    factor: float = 2.0


def _check_factor(cfg):
    if not cfg.factor > 0:
        raise ValueError(f"factor: expected a positive number, got {cfg.factor!r}")


def test_a_registered_kind_builds_decodes_and_round_trips(scratch):
    models.register_kind("test_factor", _Doubled, config=_FactorConfig, check=_check_factor)
    scratch.append((models.KINDS, "test_factor"))
    with pytest.raises(ValueError, match=r"already a layer kind"):
        models.register_kind("test_factor", models.SelfAttention, config=models.SoftmaxConfig)
    with pytest.raises(ValueError, match=r"^kind: .*configured by _FactorConfig"):
        models.SoftmaxConfig(kind="test_factor")
    with pytest.raises(ValueError, match=r"^factor:"):
        _FactorConfig(factor=-1.0)
    layer = _FactorConfig(num_heads=2, head_dim=8, factor=0.5, window=3)
    config = ModelConfig(vocab_size=16, width=16, layers=(layer, models.presets()["linear"]))
    assert from_json(ModelConfig, json.loads(json.dumps(to_json(config)))) == config
    model = models.Decoder(config, rngs=nnx.Rngs(0))
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 16
    full = jax.jit(lambda t: model(t))(tokens)
    cache = model.init_cache(2, 6)
    prefill, cache = model.prefill(tokens[:, :5], cache)
    last, _ = model.decode_step(tokens[:, 5], cache)
    np.testing.assert_allclose(prefill, full[:, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last, full[:, 5], rtol=1e-5, atol=1e-5)
    # The factor is the kind's: with factor 1 the layer is plain softmax attention.
    plain = dataclasses.replace(config, layers=(models.presets()["mha"],) * 2)
    assert models.Decoder(plain, rngs=nnx.Rngs(0))(tokens).shape == full.shape


def test_register_kind_checks_its_arguments(scratch):
    class NoExtend(nnx.Module):
        def __call__(self, x):
            return x

        def init_cache(self, batch, max_len):
            return None

    with pytest.raises(ValueError, match=r"^module: .*missing \['extend'\]"):
        models.register_kind("test_bad", NoExtend)
    with pytest.raises(TypeError, match="fields"):  # the old keyword is gone
        models.register_kind("test_bad", models.SelfAttention, fields=("windows",))
    with pytest.raises(ValueError, match=r"^config: "):
        models.register_kind("test_bad", models.SelfAttention, config=dict)
    assert "test_bad" not in models.KINDS


def test_register_preset_gives_a_sized_preset_and_its_conv_twin(scratch):
    @models.register_preset("test_wide_window", description="a window of twice the size")
    def wide(sizes):
        return sizes.base(window=2 * sizes.window)

    scratch.append((models.PRESET_REGISTRY, "test_wide_window"))
    assert models.presets()["test_wide_window"].window == 8  # read at call time
    sized = models.presets(window=5)
    assert sized["test_wide_window"].window == 10
    assert sized["test_wide_window_conv"].short_conv == models.patterns.SHORT_CONV
    with pytest.raises(ValueError, match=r"^names: 'test_wide_window' is already a preset"):
        models.register_preset("test_wide_window", lambda s: s.base(), description="x")
    with pytest.raises(ValueError, match=r"^name: .*_conv"):
        models.register_preset("test_x_conv", lambda s: s.base(), description="x")
    with pytest.raises(ValueError, match=r"^sizes: "):
        models.presets(windw=3)


def test_register_feature_map_names_a_map_for_layers(scratch):
    attn.register_feature_map("test_softplus", jax.nn.softplus)
    scratch.append((attn.FEATURE_MAPS, "test_softplus"))
    layer = models.LinearConfig(rope=False, feature_map="test_softplus")
    assert attn.linear_feature_dim("test_softplus", 8) == 8
    q = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    out = attn.linear_attention(q, q, q, feature_map="test_softplus")
    ref = attn.linear_attention(q, q, q, feature_map=jax.nn.softplus)
    np.testing.assert_array_equal(out, ref)
    model = ModelConfig(vocab_size=8, width=16, layers=(layer,))
    assert models.Decoder(model, rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.int32)).shape == (1, 4, 8)
    with pytest.raises(ValueError, match=r"^fn: "):
        attn.register_feature_map("test_bad_map", 3)


def test_model_pattern_lists_sized_presets_and_refuses_encoder_ones():
    model = ModelConfig(layers=models.pattern(("mha",), models.presets(num_heads=4, head_dim=16)))
    text = cli.pattern_help(model)
    assert "window (softmax, 4 heads x 16, window 4)" in text
    assert "mla (mla, 4 heads x 16, kv_rank 8, q_rank 16)" in text
    assert "band" not in text
    with pytest.raises(ValueError, match=r"^--model.pattern: .*'band', a bidirectional"):
        cli.with_pattern(model, "band,band", None)
    with pytest.raises(ValueError) as e:
        cli.with_pattern(model, "mha,nope", None)
    assert "band" not in str(e.value) and "'mha_conv'" in str(e.value)
    # The comparison's layer names are --model.pattern names.
    hybrid = cli.with_pattern(model, "mha_conv,linear_conv", None).layers
    assert [c.short_conv for c in hybrid] == [4, 4] and hybrid[1].kind == "linear"


def test_family_is_inherited_from_a_registered_base_or_required(scratch):
    """A kind reported in the comparison's table as softmax is one that says so, or derives
    from a softmax kind's module; a module of its own must name its family."""

    class Own(nnx.Module):
        def __call__(self, x, *, positions=None, segment_ids=None):
            return x

        def init_cache(self, batch, max_len):
            return None

        def extend(self, x, cache, start, lengths=None):
            return x, cache

    with pytest.raises(ValueError, match=r"^family: .*required: Own derives from no registered"):
        models.register_kind("test_own", Own)
    models.register_kind("test_own", Own, family="identity")
    scratch.append((models.KINDS, "test_own"))
    models.register_kind("test_doubled", _Doubled, config=_FactorConfig)
    scratch.append((models.KINDS, "test_doubled"))
    assert models.KINDS["test_own"].family == "identity"
    assert models.KINDS["test_doubled"].family == "softmax"  # _Doubled is a SelfAttention
    assert models.KINDS["sigmoid"].family == "sigmoid"
    assert models.KINDS["softpick"].family == "softpick"


def _int_output(q, k, v, **call):
    return jnp.ones((*q.shape[:3], v.shape[-1]), jnp.int32)


def _wide_output(q, k, v, **call):
    return jnp.ones((*q.shape[:3], v.shape[-1] + 2), q.dtype)


def _raises(q, k, v, **call):
    raise RuntimeError("no kernel for this shape\nsecond line")


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_int_output, r"expected .*_int_output to return a floating array \(2, 6, 2, 8\) "
                      r"= \[B,T,N,E\], got int32 \(2, 6, 2, 8\)"),
        (_wide_output, r"expected .*_wide_output to return a floating array .*got float32 "
                       r"\(2, 6, 2, 10\)"),
        (_raises, r"expected .*_raises to return its output, got RuntimeError: no kernel for "
                  r"this shape \(at .*test_registry.py:\d+\)"),
    ],
    ids=["int32", "wrong_last_axis", "raises"],
)  # fmt: skip
def test_a_function_kinds_output_is_checked_where_the_layer_receives_it(scratch, fn, message):
    """A wrong output, or an exception inside the function, is one line naming the kind and
    the function, at the first trace (jitted), not a failure in the output projection."""
    models.attention_kind("test_bad_fn", fn, family="x")
    scratch.append((models.KINDS, "test_bad_fn"))
    layer = models.KINDS["test_bad_fn"].config_class(num_heads=2, head_dim=8)
    model = models.Decoder(ModelConfig(vocab_size=16, width=16, layers=(layer,)), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 6), jnp.int32)
    with pytest.raises(ValueError, match=rf"^kind 'test_bad_fn': {message}") as e:
        jax.jit(lambda t: model(t))(tokens)
    assert "\n" not in str(e.value)


def test_attention_kind_checks_its_arguments_and_taps_its_weights(scratch):
    """Bad arguments are named; a config setting the function takes no keyword for is
    refused; the weights tap (the function on one-hot values) gives the function's weights."""
    with pytest.raises(ValueError, match=r"^fn: expected a callable"):
        models.attention_kind("test_fn", "sigmoid", family="x")
    with pytest.raises(ValueError, match=r"^config: expected a dataclass subclass"):
        models.attention_kind("test_fn", attn.sigmoid_attention, family="x", config=dict)
    with pytest.raises(ValueError, match=r"^takes: expected keywords of"):
        models.attention_kind("test_fn", attn.sigmoid_attention, family="x", takes=("bias",))
    assert "test_fn" not in models.KINDS
    models.attention_kind("test_fn", attn.sigmoid_attention, family="sigmoid")
    scratch.append((models.KINDS, "test_fn"))
    models.attention_kind("test_fn", attn.sigmoid_attention, family="sigmoid")  # a re-import
    with pytest.raises(ValueError, match=r"^kind: 'test_fn' is already a layer kind, defined by "
                       r".*attention_kind\(sigmoid_attention\); got a second one defined by "
                       r".*attention_kind\(softpick_attention\)"):  # fmt: skip
        models.attention_kind("test_fn", attn.softpick_attention, family="softpick")
    # Any callable: a partial (an AttributeError on __name__ before); two lambdas, two
    # closures over other values, two partials: each a second function under a taken name.
    sig = functools.partial(attn.sigmoid_attention)
    models.attention_kind("test_partial", sig, family="sigmoid")
    scratch.append((models.KINDS, "test_partial"))
    models.attention_kind("test_partial", functools.partial(attn.sigmoid_attention), family="s")
    with pytest.raises(ValueError, match=r"^kind: 'test_partial' is already a layer kind.*"
                       r"partial\(sigmoid_attention, \).*second one.*softcap=2\.0"):  # fmt: skip
        models.attention_kind("test_partial", functools.partial(sig, softcap=2.0), family="s")

    def closure(scale):
        return lambda q, k, v, **kw: attn.sigmoid_attention(q * scale, k, v, **kw)

    first, second = (lambda *a, **kw: attn.sigmoid_attention(*a, **kw)), closure(2.0)
    for name, one, other in (("test_lambda", first, lambda *a, **kw: first(*a, **kw)),
                             ("test_closure", second, closure(3.0))):  # fmt: skip
        models.attention_kind(name, one, family="sigmoid")
        scratch.append((models.KINDS, name))
        models.attention_kind(name, one, family="sigmoid")  # the same function again
        with pytest.raises(ValueError, match=rf"^kind: '{name}' is already a layer kind"):
            models.attention_kind(name, other, family="sigmoid")
    with pytest.raises(ValueError, match=r"^sink_logits: expected unset \(sigmoid_attention takes"):
        models.KINDS["sigmoid"].config_class(num_heads=2, head_dim=8, sink_logits=True)
    with pytest.raises(ValueError, match=r"^impl: expected 'auto' for a function kind"):
        models.KINDS["sigmoid"].config_class(num_heads=2, head_dim=8, impl="blockwise")
    layer = models.KINDS["sigmoid"].config_class(num_heads=2, head_dim=8)
    config = ModelConfig(vocab_size=16, width=16, layers=(layer,))
    model = models.Decoder(config, rngs=nnx.Rngs(0))
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 16
    _, weights = models.capture_weights(model, tokens)
    w = np.asarray(weights[0])  # [B,N,T,S]
    above = np.triu(np.ones((6, 6), bool), 1)  # future keys: causal, weight 0
    assert w.shape == (2, 2, 6, 6) and (w[..., above] == 0).all() and (w[..., ~above] > 0).all()
    # Sigmoid weights are sigmoid(s - log n): the first query sees one key, n = 1.
    assert 0 < w[0, 0, 0, 0] < 1
