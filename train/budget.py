"""What a training run costs: model FLOPs per update, and the time a GPU is predicted to take.

The GPU scales of the experiments (``--scale gpu``) are sized before any of
them ran on one, so their time is predicted, not measured: model FLOPs (PaLM's
definition, ``model_flops``) over an assumed share of the device's measured
matmul rate, plus an assumed cost per update and per compiled program.
``H200`` holds those numbers and says where each comes from; once the device
run (``bench/device.py``'s training phase) has timed the profile's own steps on
a GPU, its step times replace the FLOP estimate (``Device.step_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "H200",
    "Device",
    "attention_flops",
    "level_flops",
    "model_flops",
    "predict_comparison",
    "prediction_text",
    "visible_keys",
]


@dataclass(frozen=True)
class Device:
    """A GPU's rates for predicting a run's time.

    Attributes:
      name: the device.
      matmul_flops: its measured bf16 matmul rate (FLOP/s).
      efficiency: the assumed share of that rate a training step's model FLOPs run at.
      update_s: the assumed fixed cost of one update (optimizer, dispatch, host).
      compile_s, compile_layer_s: the assumed time to compile one program (an update or
        an evaluation): ``compile_s`` plus ``compile_layer_s`` per layer.
    """

    name: str
    matmul_flops: float
    efficiency: float
    update_s: float
    compile_s: float
    compile_layer_s: float

    def step_seconds(self, flops: float) -> float:
        """One step of ``flops`` model FLOPs."""
        return flops / (self.matmul_flops * self.efficiency) + self.update_s

    def forward_seconds(self, flops: float) -> float:
        """The forward pass alone of a step of ``flops`` (a third of its FLOPs)."""
        return flops / 3 / (self.matmul_flops * self.efficiency)

    def compile_seconds(self, num_layers: int) -> float:
        """One program of a ``num_layers``-layer model."""
        return self.compile_s + self.compile_layer_s * num_layers

    def assumptions(self) -> str:
        """The rates a prediction rests on, in words."""
        return (
            f"model FLOPs at {self.efficiency:.0%} of its measured "
            f"{self.matmul_flops / 1e12:.0f} TFLOP/s matmul rate, {self.update_s * 1e3:g} ms "
            f"an update, {self.compile_s:g} s + {self.compile_layer_s:g} s a layer to compile "
            "a program: assumptions, until the device run times these steps"
        )


# bench/results/gpu-NVIDIA_H200.md measured the bf16 matmul rate (667 TFLOP/s, an
# 8192^3 product). The rest are assumptions, stated as such wherever a prediction is
# printed: a quarter of that rate for narrow models at T <= 1024 (cuDNN's attention
# itself ran at 12% of peak forward + backward at T = 1024, the MLPs' products
# near the matmul rate), 2 ms an update, 5 s + 4 s a layer to compile a program
# (XLA:CPU compiles these models' updates in 3 to 40 s; the GPU's autotuning adds).
H200 = Device(
    name="NVIDIA H200",
    matmul_flops=667e12,
    efficiency=0.25,
    update_s=2e-3,
    compile_s=5.0,
    compile_layer_s=4.0,
)


def visible_keys(layer, seq_len: int) -> list[int]:
    """Per query position t, the keys a causal softmax-family layer reads: those its own mask
    (``layer.mask(causal=True)``) allows; MoBA's, its own block's and ``top_k - 1`` earlier;
    PaTH's (no mask), every earlier one (its Householder transforms are not counted)."""
    if not hasattr(layer, "mask"):
        return list(range(1, seq_len + 1))
    if layer.kind == "moba":
        bs, k = layer.block_size, layer.top_k - 1
        return [t % bs + 1 + min(k, t // bs) * bs for t in range(seq_len)]
    positions = np.arange(seq_len)
    allowed = layer.mask(True).allowed(positions, positions)
    return [int(n) for n in np.asarray(allowed).sum(axis=-1)]


def attention_flops(layer, seq_len: int) -> int:
    """A layer's own FLOPs beyond its projections for one sequence, forward + backward: a
    softmax-family layer's logits and values (PaTH's twice: each query also passes the
    transforms of every earlier block of keys, two matmuls of its own per block), and a
    log-linear layer's reads of its levels (``level_flops``); 0 for the others."""
    from models import KINDS

    if getattr(layer, "num_levels", 0):
        return level_flops(layer, seq_len)
    if KINDS[layer.kind].family not in ("softmax", "sparse"):
        return 0
    N = layer.num_heads
    # MLA (naive form) scores over its no-RoPE and RoPE dims, and reads values of E.
    qk = layer.qk_nope_dim + layer.rope_head_dim if layer.kind == "mla" else layer.head_dim
    v = layer.value_dim
    pairs = sum(visible_keys(layer, seq_len))
    flops = 3 * 2 * N * (qk + v) * pairs
    if layer.kind == "moba":  # the gate: each query against the means of its earlier blocks
        flops += 2 * N * qk * sum(t // layer.block_size for t in range(seq_len))
    if layer.kind == "path":  # q' <- q' (I - W^T X) past each key block: 4 H per pair
        flops *= 2
    return flops


def level_flops(layer, seq_len: int) -> int:
    """Log-linear attention's level reads for one sequence, forward + backward: each token
    reads ``ceil(log2(T / C))`` levels above its chunk, each ``2 H E`` for its state and its
    gradient's (``4 H E`` a level forward, as ``bench/_device_families_plan`` counts it);
    a layer's one state (its chunkwise products, as the parent family's) is not counted."""
    C, E = layer.chunk_size, layer.value_dim
    H = getattr(layer, "state_dim", layer.head_dim)  # Mamba-2's keys are its state's
    N = getattr(layer, "num_value_heads", layer.num_heads)
    levels = max(0, (-(-seq_len // C) - 1).bit_length())
    return 3 * 4 * N * H * E * levels * seq_len


def model_flops(model_config, params: int, seq_len: int, batch: int) -> dict:
    """Model FLOPs of one training step (forward + backward) on ``batch x seq_len`` tokens.

    ``6 x dense x tokens`` with ``dense`` every parameter but the embedding table's
    lookup, plus the output head's ``D x V`` (tied: ``params`` itself), and the
    layers' own products (``attention_flops``: softmax-family logits, PaTH's transforms,
    log-linear levels). The fixed-state layers' chunkwise products are not counted (1-7%
    of a step's matmuls at C = 64).
    An evaluation's forward is a third of it.

    Returns:
      ``dict(dense_params, flops, attention_flops)``.
    """
    table = model_config.vocab_size * model_config.width
    dense = params if model_config.tied_embeddings else params - table
    tokens = seq_len * batch
    attention = batch * sum(attention_flops(layer, seq_len) for layer in model_config.layers)
    return {"dense_params": dense, "flops": 6 * dense * tokens + attention,
            "attention_flops": attention}  # fmt: skip


def predict_comparison(config, device: Device = H200) -> dict:
    """A comparison's (``train.variants.CompareConfig``) predicted time on ``device``.

    Per variant: its parameters (matched), model FLOPs per update, the runs it
    may train (the sweep, every widening ``edge_lrs`` allows, ``best_lr_seeds``),
    each run's updates and evaluations (a forward is a third of an update's
    FLOPs; the final evaluation's ``final_eval_batches``; every test length as
    many tokens as an evaluation), and the programs it compiles (the update, the
    evaluation, one per test length past 1x; later rates reuse them).

    Returns:
      ``dict(device, variants: {name: dict(params, flops_per_update, runs, run_s,
      compile_s, seconds)}, seconds)``.
    """
    from train.variants import param_count, run_config

    c, t = config, config.train
    out = {}
    for v in c.variants:
        rc = run_config(c, v, c.lrs[0], c.seeds[0]).with_task_vocab()
        params = param_count(rc.model)
        flops = model_flops(rc.model, params, t.task.seq_len, t.batch_size)["flops"]
        runs = len(c.seeds) * (len(c.lrs) + c.edge_lrs) + len(c.best_lr_seeds)
        evals = t.steps // t.eval_every - (t.steps % t.eval_every == 0)  # before the last
        batches = evals * t.eval_batches + (t.final_eval_batches or t.eval_batches)
        batches += len(c.test_lengths) * t.eval_batches
        run_s = t.steps * device.step_seconds(flops) + batches * device.forward_seconds(flops)
        programs = 2 + sum(k != 1 for k in c.test_lengths)
        compile_s = programs * device.compile_seconds(len(rc.model.layers))
        out[v] = {
            "params": params,
            "flops_per_update": flops,
            "runs": runs,
            "run_s": run_s,
            "compile_s": compile_s,
            "seconds": runs * run_s + compile_s,
        }
    return {
        "device": device,
        "variants": out,
        "seconds": sum(x["seconds"] for x in out.values()),
    }


def prediction_text(prediction: dict, what: str) -> str:
    """``predict_comparison``'s (or another prediction's) table, its assumptions beside it."""
    d = prediction["device"]
    lines = [
        f"{what}: predicted {prediction['seconds']:.0f} s on one {d.name} ({d.assumptions()})",
        "",
        "| variant | params | GFLOP/update | ms/update | runs | s/run | compile s | total s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in prediction["variants"].items():
        ms = d.step_seconds(v["flops_per_update"]) * 1e3
        lines.append(
            f"| {name} | {v['params'] / 1e6:.1f}M | {v['flops_per_update'] / 1e9:,.0f} | "
            f"{ms:.1f} | {v['runs']} | {v['run_s']:.0f} | {v['compile_s']:.0f} | "
            f"{v['seconds']:.0f} |"
        )
    return "\n".join(lines)
