"""bench/_device_train.py: the training-step phase of bench/device.py.

The fast tests check the items' order, the model FLOP count and the dtype
census on hand-sized inputs; the integration test runs two variants' dry-run
items (a CPU, tiny sizes) through ``run_item`` and ``markdown``. Timings are
never asserted.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import _device_train as phase
from bench._device_common import Context
from models import ModelConfig, presets
from models.latent import LatentConfig
from models.softmax import SoftmaxConfig
from models.sparse import MobaConfig


def test_items_put_the_baseline_and_the_best_first_and_name_every_compared_variant():
    from configs.compare_lm import VARIANTS

    names = [item["name"] for item in phase.items(dry_run=False)]
    assert names[:3] == ["mha", "gated_deltanet", "mamba2"]
    assert sorted(names) == sorted(VARIANTS) and names == [
        item["variant"] for item in phase.items(dry_run=True)
    ]


def test_visible_keys_follow_the_layers_masks():
    assert phase.visible_keys(SoftmaxConfig(), 4) == [1, 2, 3, 4]
    assert phase.visible_keys(SoftmaxConfig(window=3), 6) == [1, 2, 3, 3, 3, 3]
    # StreamingLLM: a window of 2 and the first position.
    assert phase.visible_keys(SoftmaxConfig(window=2, initial_tokens=1), 5) == [1, 2, 3, 3, 3]
    # MoBA: its own block (causally) and top_k - 1 earlier blocks of 2.
    assert phase.visible_keys(MobaConfig(block_size=2, top_k=2), 6) == [1, 2, 3, 4, 3, 4]


def test_model_flops_count_six_per_parameter_and_token_and_the_causal_attention():
    layers = (SoftmaxConfig(num_heads=4, head_dim=8), SoftmaxConfig(num_heads=4, head_dim=8))
    model = ModelConfig(vocab_size=256, width=32, layers=layers)
    T, B, params = 4, 2, 1000
    # Per layer and sequence: 3 (forward + backward) x 2 x N x (H + E) x T(T+1)/2 pairs.
    attention = B * 2 * (3 * 2 * 4 * (8 + 8) * 10)
    flops = phase.model_flops(model, params, T, B)
    assert flops == {
        "dense_params": params,  # tied: the table is the output head's matmul
        "flops": 6 * params * T * B + attention,
        "attention_flops": attention,
    }
    # Untied: the embedding table's parameters compute nothing (the head's are in params).
    untied = ModelConfig(vocab_size=256, width=32, layers=layers, tied_embeddings=False)
    assert phase.model_flops(untied, params + 256 * 32, T, B) == flops
    # MLA scores over nope + rope dims (8 + 4), values over E = 8; fixed states add nothing.
    mla = LatentConfig(num_heads=4, head_dim=8, rope_head_dim=4)
    assert phase.attention_flops(mla, 4) == 3 * 2 * 4 * (12 + 8) * 10
    gdn = presets(num_heads=4, head_dim=8)["gated_deltanet"]
    assert phase.attention_flops(gdn, 4) == 0


def test_the_dtype_census_counts_scan_bodies_by_their_length():
    def f(x, w):
        def body(c, _):
            return c, (c @ c.T).sum()

        _, ys = jax.lax.scan(body, x, None, length=3)
        return ys.sum() + (x.astype(jnp.float32) @ w).sum()

    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 5), jnp.float32)
    dots, kernels = phase.dtype_census(jax.make_jaxpr(f)(x, w).jaxpr)
    assert dots == {"bfloat16 x bfloat16": 3 * 2 * 4 * 4 * 8, "float32 x float32": 2 * 4 * 5 * 8}
    assert kernels == {}


def test_markdown_reports_the_size_and_each_measured_variant():
    row = dict(name="mha", variant="mha", status="ok", params=16.9e6, tokens_per_s=1e6,
               tflops=100.0, mfu_peak=0.1, mfu_matmul=0.15, ms=32.8, program_bytes=2**30,
               bf16_dot_share=0.99, kernels={"pallas_call": ["bfloat16"]})  # fmt: skip
    info = dict(dry_run=False, matmul_tflops=700.0, peak_tflops=989.0)
    text = phase.markdown([row, dict(name="mla", variant="mla", status="failed: X")], info)
    assert "width 512, 8 layers, 8 heads of 64, T = 1024, batch 32 (32,768 tokens" in text
    assert "| mha | 16.90M | 1,000,000 | 100 | 10.0% | 15.0% | 32.80 | 1,024 | 99.0% |" in text
    assert "| mla |" not in text and "pallas_call (bfloat16)" in text and "(989 TFLOP/s)" in text


@pytest.mark.integration
def test_a_dry_run_trains_two_variants_and_reports_them():
    ctx = Context(dry_run=True, platform="cpu", device_kind="cpu", matmul_tflops=0.05,
                  peak_tflops=None, deadline=time.time() + 600, fla_path=None,
                  repeats=2)  # fmt: skip
    rows = []
    for item in phase.items(dry_run=True)[:2]:
        result = phase.run_item(item, ctx)
        assert result["status"] == "ok", result
        assert np.isfinite(result["loss"]) and np.isfinite(result["grad_norm"])
        assert result["tokens"] == 2 * 32 and result["tokens_per_s"] > 0
        assert result["model_flops"] > 0 and result["program_bytes"] > 0
        assert result["mfu_peak"] is None and result["mfu_matmul"] > 0
        # The projections and MLPs compute in bf16; the head's logits are float32.
        assert 0.5 < result["bf16_dot_share"] < 1.0
        rows.append(dict(item, **result))
    assert rows[1]["attention_flops"] == 0 < rows[0]["attention_flops"]  # gated_deltanet, mha
    # Matched parameters: the MLP absorbs what the delta rule's layers add.
    assert abs(rows[1]["params"] - rows[0]["params"]) < 0.02 * rows[0]["params"]
    text = phase.markdown(rows, dict(dry_run=True, matmul_tflops=0.05, peak_tflops=None))
    assert "width 32, 2 layers" in text and "| mha |" in text and "| gated_deltanet |" in text
    late = Context(**{**ctx.__dict__, "deadline": time.time() - 1})
    assert phase.run_item(phase.items(True)[0], late) == {"status": "not measured: time budget"}
