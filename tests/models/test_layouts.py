"""The production hybrids (``models.layouts``) and their new parts: MiniMax-01's lightning
attention against its formula in float64, its depth-set decay, NoPE MLA.

Decoding, packing and serving of lightning ride on ``KINDS["linear_decay"]``, NoPE MLA on
``KINDS["mla"]`` and the q/k norm on ``KINDS["gqa"]`` (``tests/models/common.py``); the
gated q/k-normed layer against its formula is ``tests/models/test_gated.py``'s.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from attn.scores import alibi_slopes
from configs import compare_lm_english
from models.lightning import NORM_EPS, depth_factor
from tests.models.common import WIDTH, B
from tests.util import normal, rel_err
from train.variants import run_config, softmax_layers

T = 9


def attention_at(name: str, L: int) -> list[int]:
    """0-based layers of layout ``name`` at depth L whose preset is not its linear one."""
    names = models.layout(name, L)
    return [i for i, n in enumerate(names) if n != names[0]]


def test_layouts_place_attention_where_the_released_models_do():
    # Qwen3-Next-80B: full attention at (i + 1) % 4 == 0 of 48 layers.
    assert attention_at("qwen3_next", 48) == list(range(3, 48, 4))
    # Kimi-Linear-48B's full_attn_layers, 1-based: 4, 8, ..., 24 and 27 of 27.
    assert [i + 1 for i in attention_at("kimi_linear", 27)] == [4, 8, 12, 16, 20, 24, 27]
    # Nemotron-H-8B's 28 mixers ("M-M-M-M*-M-M-M-M-M*-..." without its MLPs).
    assert attention_at("nemotron_h", 28) == [4, 10, 16, 22]
    # MiniMax-Text-01's attn_type_list = [0] * 7 + [1], ten times.
    assert models.layout("minimax01", 80) == (("lightning",) * 7 + ("minimax_attention",)) * 10
    # The English comparison's depth, and the frontier's.
    assert {n: attention_at(n, 4) for n in models.LAYOUTS} == {
        "qwen3_next": [3], "kimi_linear": [3], "nemotron_h": [2], "minimax01": [3]
    }  # fmt: skip
    assert {n: attention_at(n, 2) for n in models.LAYOUTS} == {n: [1] for n in models.LAYOUTS}


BAD_LAYOUTS = [(("qwen4", 4), "name"), (("qwen3_next", 0), "num_layers"),
               (("qwen3_next", 2.0), "num_layers")]  # fmt: skip


@pytest.mark.parametrize(("args", "field"), BAD_LAYOUTS)
def test_a_bad_layout_request_names_the_argument(args, field):
    with pytest.raises(ValueError, match=field):
        models.layout(*args)


def test_the_layouts_attention_layers_are_what_their_models_ship():
    p = models.presets(num_heads=4, head_dim=16, gqa_kv_heads=2)
    qwen, kimi, nope, minimax = (p[n] for n in ("qwen3_next_attention", "kimi_mla", "nope_gqa",
                                                "minimax_attention"))  # fmt: skip
    assert (qwen.kv_heads, qwen.rotary_dim, qwen.qk_norm, qwen.output_gate) == (
        2, 4, True, "elementwise")  # fmt: skip
    assert (kimi.kind, kimi.rope, kimi.q_rank) == ("mla", False, None)
    assert (nope.kind, nope.rope, nope.kv_heads) == ("softmax", False, 2)
    assert (minimax.kv_heads, minimax.rotary_dim, minimax.rope_base) == (2, 8, 1e7)


def test_each_layout_compares_at_the_english_comparisons_size_with_matched_parameters():
    config = dataclasses.replace(compare_lm_english.get_config(), match_params="mha")
    for name in models.LAYOUTS:
        # run_config raises where the MLP cannot bring the parameters within 2% of MHA's
        run = run_config(config, name, lr=1e-2, seed=0)
        assert len(run.model.layers) == 4
        assert softmax_layers(config, name) == [a + 1 for a in attention_at(name, 4)]


def lightning_formula(p, x, lam, N, H):
    """MiniMax-01's lightning layer from its equations: SiLU q, k, v; ``S_t = lam S_{t-1} +
    k_t^T v_t``, ``o_t = q_t S_t``; ``(sigmoid(x W_g) * RMSNorm_{NH}(o)) W_o``. Any float
    dtype (float64 under ``jax.enable_x64``)."""
    q, k, v = (jax.nn.silu(x @ p[n]).reshape(B, T, N, H) for n in ("q", "k", "v"))
    S, outs = jnp.zeros((B, N, H, H), x.dtype), []
    for t in range(T):
        S = lam[None, :, None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(jnp.einsum("bnh,bnhe->bne", q[:, t], S))
    o = jnp.stack(outs, axis=1).reshape(B, T, N * H)
    normed = o / jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + NORM_EPS) * p["scale"]
    return (jax.nn.sigmoid(x @ p["g"]) * normed) @ p["o"]


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_lightning_is_minimax_formula_with_its_gradients(form):
    N, H = 4, 8
    cfg = models.LightningConfig(num_heads=N, head_dim=H, chunk_size=4, form=form,
                                 decay_factor=0.5)  # fmt: skip
    layer = models.LightningAttention(cfg, WIDTH, causal=True, dtype=jnp.float32,
                                      param_dtype=jnp.float32, rngs=nnx.Rngs(1))  # fmt: skip
    layer.out_norm.scale.set_value(1.0 + 0.3 * normal(7, (N * H,)))
    lam = np.exp(-alibi_slopes(N).astype(np.float64) * 0.5)
    assert np.allclose(cfg.decay_values(), lam, rtol=1e-12)
    x, ct = normal(2, (B, T, WIDTH)), normal(3, (B, T, WIDTH))
    mods = {"q": layer.q_proj, "k": layer.k_proj, "v": layer.v_proj, "g": layer.out_gate,
            "o": layer.o_proj}  # fmt: skip

    def params(dtype):
        p = {n: jnp.asarray(m.kernel[...], dtype) for n, m in mods.items()}
        return {**p, "scale": jnp.asarray(layer.out_norm.scale[...], dtype)}

    y = nnx.jit(lambda m, x: m(x))(layer, x)
    grads, dx = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) * ct), argnums=(0, 1)))(layer, x)
    with jax.enable_x64():
        p64, x64, ct64 = params(jnp.float64), jnp.asarray(x, jnp.float64), jnp.asarray(ct, float)
        want = lightning_formula(p64, x64, jnp.asarray(lam), N, H)
        want_p, want_x = jax.grad(
            lambda p, x: jnp.sum(lightning_formula(p, x, jnp.asarray(lam), N, H) * ct64),
            argnums=(0, 1),
        )(p64, x64)
    assert rel_err(y, want) <= 1e-5
    assert rel_err(dx, want_x) <= 1e-4
    attrs = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "g": "out_gate", "o": "o_proj"}
    for name, attr in attrs.items():
        assert rel_err(getattr(grads, attr).kernel[...], want_p[name]) <= 1e-4, name
    assert rel_err(grads.out_norm.scale[...], want_p["scale"]) <= 1e-4


def test_pattern_sets_lightnings_decay_by_depth_and_keeps_a_set_one():
    layers = models.pattern(("lightning", "lightning", "lightning", "mha"))
    assert [a.decay_factor for a in layers[:3]] == [depth_factor(i, 4) for i in range(3)]
    assert depth_factor(0, 4) == 1 + 1e-5 and math.isclose(depth_factor(2, 4), 1 / 3 + 1e-5)
    assert depth_factor(0, 1) == 1 + 1e-5  # one layer: MiniMax's 1 - l / (L - 1) has no L - 1
    fixed = models.LightningConfig(decay_factor=0.25)
    assert fixed.at_depth(3, 4) is fixed
    # Unset, the first layer's: the fastest forgetting.
    first = models.pattern(("lightning",))[0]
    assert models.LightningConfig().decay_values() == first.decay_values()


BAD_LIGHTNING = [
    (dict(decay=0.9), "decay"),
    (dict(gating=True), "gating"),
    (dict(decay_factor=0.0), "decay_factor"),
    (dict(decay_factor="1"), "decay_factor"),
]


@pytest.mark.parametrize(("fields", "field"), BAD_LIGHTNING)
def test_a_bad_lightning_config_names_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        models.LightningConfig(**fields)


def test_lightning_refuses_a_bidirectional_stack():
    with pytest.raises(ValueError, match="kind"):
        models.Encoder(models.ModelConfig(layers=models.pattern(("lightning",))),
                       rngs=nnx.Rngs(0))  # fmt: skip


def test_nope_mla_reads_no_positions_where_rope_mla_does():
    """Kimi Linear's MLA: spreading the positions apart (the same order, so the same causal
    mask) changes nothing without RoPE, and the distances RoPE reads with it."""
    x, pos = normal(4, (B, T, WIDTH)), jnp.broadcast_to(jnp.arange(T), (B, T))
    for rope, moved in ((False, False), (True, True)):
        cfg = models.LatentConfig(num_heads=4, head_dim=8, kv_rank=8, rope=rope)
        layer = models.LatentAttention(cfg, WIDTH, causal=True, dtype=jnp.float32,
                                       param_dtype=jnp.float32, rngs=nnx.Rngs(0))  # fmt: skip
        y0, y3 = layer(x, positions=pos), layer(x, positions=3 * pos)
        assert (rel_err(y3, y0) > 1e-3) == moved
