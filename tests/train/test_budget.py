"""train.budget: a comparison's predicted GPU time, its arithmetic on a tiny config."""

import dataclasses

import pytest

from train.budget import (
    H200,
    Device,
    attention_flops,
    model_flops,
    predict_comparison,
    prediction_text,
)
from train.config import TrainConfig
from train.tasks import TaskConfig
from train.variants import CompareConfig, param_count, run_config


def test_a_comparisons_prediction_counts_its_runs_updates_evaluations_and_programs():
    device = Device("test", matmul_flops=1e12, efficiency=0.5, update_s=1e-3, compile_s=2.0,
                    compile_layer_s=1.0)  # fmt: skip
    assert device.step_seconds(1e9) == pytest.approx(2e-3 + 1e-3)
    assert device.forward_seconds(3e9) == pytest.approx(2e-3)
    assert device.compile_seconds(4) == 6.0
    train = TrainConfig(
        task=TaskConfig(name="bytes", seq_len=16), steps=10, batch_size=2, eval_every=4,
        eval_batches=2, final_eval_batches=5,
    )  # fmt: skip
    config = CompareConfig(
        train=train, variants=("mha", "gated_deltanet"), lrs=(1e-3, 1e-2), edge_lrs=1,
        seeds=(0,), best_lr_seeds=(1,), num_layers=2, test_lengths=(1, 2, 4),
    )  # fmt: skip
    got = predict_comparison(config, device)
    for v in config.variants:
        rc = run_config(config, v, 1e-3, 0).with_task_vocab()
        flops = model_flops(rc.model, param_count(rc.model), 16, 2)["flops"]
        # Evaluations at steps 4 and 8 read 2 batches, the last 5; then 3 lengths of 2.
        run_s = 10 * device.step_seconds(flops) + (2 + 2 + 5 + 3 * 2) * flops / 3 / 0.5e12
        programs = 2 + 2  # update, evaluation, and the lengths 2 and 4
        want = dict(params=param_count(rc.model), flops_per_update=flops, runs=1 * (2 + 1) + 1,
                    run_s=run_s, compile_s=programs * 4.0)  # fmt: skip
        assert got["variants"][v] == pytest.approx({**want, "seconds": 4 * run_s + 16.0})
    assert got["seconds"] == pytest.approx(sum(x["seconds"] for x in got["variants"].values()))
    text = prediction_text(got, "tiny")
    assert text.startswith(f"tiny: predicted {got['seconds']:.0f} s on one test (model FLOPs at")
    assert "| gated_deltanet |" in text and "assumptions" in text
    assert dataclasses.asdict(H200)["matmul_flops"] == 667e12  # bench/results/gpu-NVIDIA_H200.md


def test_path_s_transforms_and_the_log_linear_levels_are_counted():
    """(Both were priced as their parents: PaTH as MHA, log-linear Mamba-2 as Mamba-2.)"""
    import models

    T = 1024
    mha = models.SoftmaxConfig(num_heads=4, head_dim=32)
    path = models.PathConfig(num_heads=4, head_dim=32)
    assert attention_flops(path, T) == 2 * attention_flops(mha, T) > 0
    mamba = models.Mamba2Config(num_heads=4, head_dim=32, state_dim=16, chunk_size=64)
    log = models.LogLinearMamba2Config(num_heads=4, head_dim=32, state_dim=16, chunk_size=64)
    # 16 chunks: each token reads log2(16) = 4 levels above its chunk, 4 H E a level forward
    assert attention_flops(mamba, T) == 0
    assert attention_flops(log, T) == 3 * 4 * 4 * 16 * 32 * 4 * T
    delta = models.LogLinearDeltaConfig(num_heads=2, head_dim=16, chunk_size=64)
    assert attention_flops(delta, 2 * 64) == 3 * 4 * 2 * 16 * 16 * 1 * 128  # 2 chunks: 1 level
