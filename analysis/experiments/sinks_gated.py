"""Does gated attention remove the attention sink? (Qiu et al. 2025, on English text)

    python -m analysis.experiments.sinks_gated [--quick] [--out DIR]

Gated attention multiplies each head's output by ``sigmoid(x W_g)`` before the
output projection (``MaskedConfig.output_gate``); its paper reports that the gate
removes the attention sink (the first token's share of attention falls from 46.7%
to 4.8% in its 1B models) and the massive activations that come with it. Claim 12
measured the sink without the gate: this experiment first finds where ungated
MHA shows one on English, then trains the gated model beside it.

1. The onset: ungated MHA at each size of ``base.sizes`` (smallest first; the
   layer, T, steps, batches and optimizer of ``base.train``), its heads'
   first-token mass on held-out windows at every checkpoint (mass against steps
   and width), until a size has a sink (a head above ``metrics.SINK_THRESHOLD``
   at its last step): the onset. With none, the largest size is the one used.
2. The same model with the output gate (``gate``) at that size: the same data,
   seed, steps and optimizer.
3. For both: the first-token mass per layer and the sink rate, the massive
   activations (``metrics.massive_activations`` of ``Decoder.hidden_states``: the
   largest |h| per layer and its ratio to the median), and streaming perplexity
   past T (``sinks_streaming``'s streams) with full attention, a window of T,
   and the window plus ``num_initial`` sinks renumbered as StreamingLLM does.

The claim's criterion is ``CRITERION``, written before the first run: it holds
when ungated MHA has a sink and the gated model at the same size and budget has
none, its largest head first-token mass at most half of MHA's. With no sink in
ungated MHA at any size it does not hold (there is nothing to remove), and the
measured line says so.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below run is one line
    from train.interrupt import exit_on_sigint

    exit_on_sigint("python -m analysis.experiments.sinks_gated")

import dataclasses
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import train
import train.tasks
from analysis import metrics, plots
from analysis.experiments import _common
from analysis.experiments import sinks_streaming as ss
from analysis.streaming import stream_nll
from models.heads import OUTPUT_GATES

NAME = "sinks_gated"
MODELS = ("mha", "gated")
STREAMS = ("full", "window", "streaming_llm")
# The largest head first-token mass the gated model may keep, as a share of MHA's.
MASS_RATIO = 0.5
CRITERION = (
    f"ungated MHA has a sink (a head's first-token mass > {metrics.SINK_THRESHOLD}) and "
    f"gated MHA at the same size, data and steps has none, its largest head mass at most "
    f"{MASS_RATIO}x MHA's"
)


@dataclasses.dataclass(frozen=True)
class Config:
    """The experiment.

    Attributes:
      base: the sink experiment's config (``sinks_streaming.Config``): its ``train``
        (ungated full causal softmax layers on ``bytes``), its streams and its
        ``sizes``, the onset's sweep, smallest first (``sizes_bos`` is not read:
        every run keeps ``train.task.bos``).
      gate: the gated model's ``output_gate`` (``models.heads.OUTPUT_GATES``).
    """

    base: ss.Config
    gate: str = "elementwise"

    def __post_init__(self):
        if not isinstance(self.base, ss.Config):
            raise ValueError(f"base: expected a sinks_streaming.Config, got {self.base!r}")
        if not self.base.sizes:
            raise ValueError("base.sizes: expected the onset's sizes, got none")
        if self.gate not in OUTPUT_GATES:
            raise ValueError(f"gate: expected one of {OUTPUT_GATES}, got {self.gate!r}")
        if any(a.output_gate is not None for a in self.base.train.model.layers):
            raise ValueError("base.train.model.layers: expected ungated layers (MHA)")


def gated(t, gate: str):
    """``t`` with every layer's output gated by ``gate``."""
    layers = tuple(dataclasses.replace(a, output_gate=gate) for a in t.model.layers)
    return dataclasses.replace(t, model=dataclasses.replace(t.model, layers=layers))


def _name(size: ss.Size, model: str) -> str:
    return f"{model}_w{size.width}_l{size.layers}_h{size.heads}"


@nnx.jit
def _hidden(model, tokens):
    return model.hidden_states(tokens)


def _onset(config: Config, out_dir: Path, tokens) -> tuple[list[dict], ss.Size, object]:
    """Ungated MHA at each size until one has a sink: the rows, the size, its run config."""
    t, rows = config.base.train, []
    for size in config.base.sizes:
        run = dataclasses.replace(ss.size_run(t, size, t.task.bos), ckpt_every=t.ckpt_every)
        summary, workdir = _common.train_run(run, out_dir, _name(size, "mha"))
        history = []
        for step in ss.checkpoint_steps(run):
            mass, rate = ss.sink_stats(train.load_run(workdir, step)[0], tokens)
            history.append({"step": step, "max_first_token_mass": float(mass.max()),
                            "sink_rate": rate.overall})  # fmt: skip
        rows.append({**dataclasses.asdict(size), "params": summary["params"],
                     "test_loss": summary["test_loss"], "history": history})  # fmt: skip
        if history[-1]["sink_rate"] > 0:
            break
    return rows, size, run


def _measure(config: Config, workdir: Path, tokens, streams) -> dict:
    """One final model's sinks, massive activations and streaming perplexity per window."""
    base, model = config.base, train.load_run(workdir)[0]
    T, K = base.train.task.seq_len, base.stream_factor
    mass, rate = ss.sink_stats(model, tokens)
    massive = metrics.massive_activations(jax.device_get(_hidden(model, tokens)))
    renumber = {"streaming_llm": (base.num_initial, T)}
    ppl = {}
    for v in STREAMS:
        nll = stream_nll(ss.variant_model(model, v, T, base.num_initial), *streams,
                         renumber.get(v))  # fmt: skip
        ppl[v] = np.exp(nll.reshape(nll.shape[0], K, T).mean(axis=(0, 2)))
    return {
        "first_token_mass": mass,
        "first_token_mass_per_layer": mass.mean(1),
        "max_first_token_mass": float(mass.max()),
        "sink_rate": rate.overall,
        "massive_top": massive.top,
        "massive_median": massive.median,
        "massive_ratio": massive.ratio,
        "perplexity_per_window": ppl,
    }


def run(config: Config, out_dir: Path) -> dict:
    """The onset, the gated model beside MHA at its size, both measured; writes the results."""
    timer, out_dir = _common.Timer(), Path(out_dir)
    base = config.base
    t = base.train
    task = train.tasks.make_task(t.task)
    tokens = task.batch(t.seed, "test", 0, base.eval_batch)["tokens"]
    rows, size, mha_run = _onset(config, out_dir, tokens)
    _common.train_run(gated(mha_run, config.gate), out_dir, _name(size, "gated"))
    streams = ss.held_out_streams(base)
    measured = {m: _measure(config, _common.run_dir(out_dir, _name(size, m)), tokens, streams)
                for m in MODELS}  # fmt: skip
    mha, gate = measured["mha"], measured["gated"]
    has_sink = mha["sink_rate"] > 0
    kept = gate["max_first_token_mass"] <= MASS_RATIO * mha["max_first_token_mass"]
    holds = has_sink and gate["sink_rate"] == 0 and kept
    where = (f"sink onset at width {size.width} ({rows[-1]['params']:,} params)" if has_sink
             else f"no sink in ungated MHA up to width {size.width} ({rows[-1]['params']:,} "
             "params)")  # fmt: skip
    entry = _common.claim(
        f"{where}; sink rate MHA {mha['sink_rate']:.2f}, gated {gate['sink_rate']:.2f}; largest "
        f"head first-token mass MHA {mha['max_first_token_mass']:.2f}, gated "
        f"{gate['max_first_token_mass']:.2f}; largest |h| MHA {mha['massive_top'].max():.1f}, "
        f"gated {gate['massive_top'].max():.1f}",
        CRITERION,
        holds,
    )
    _plots(config, rows, measured, out_dir)
    results = {
        "name": NAME,
        "claim": entry,
        "runtime_s": timer(),
        "train_length": t.task.seq_len,
        "onset": rows,
        "size": dataclasses.asdict(size),
        "models": measured,
        "config": config,
    }
    return _common.write_results(out_dir, results, _table(config, rows, measured))


def _plots(config: Config, rows: list[dict], measured: dict, out_dir: Path) -> None:
    T = config.base.train.task.seq_len
    steps = [h["step"] for h in rows[0]["history"]]
    plots.curves(
        steps,
        {f"width {r['width']}": [h["max_first_token_mass"] for h in r["history"]] for r in rows},
        out_dir / "sink_onset.png",
        "training step",
        "largest first-token mass of a head (MHA)",
        hline=metrics.SINK_THRESHOLD,
    )
    L = len(measured["mha"]["first_token_mass_per_layer"])
    plots.curves(
        list(range(L)),
        {m: measured[m]["first_token_mass_per_layer"] for m in MODELS},
        out_dir / "first_token_mass.png",
        "layer",
        "mean first-token mass",
        hline=metrics.SINK_THRESHOLD,
    )
    plots.curves(
        list(range(L + 1)),
        {m: measured[m]["massive_top"] for m in MODELS},
        out_dir / "massive_activations.png",
        "residual stream after layer (0: the embedding)",
        "largest |h|",
    )
    ends = [T * (k + 1) for k in range(config.base.stream_factor)]
    plots.curves(
        ends,
        {f"{m}, {v}": measured[m]["perplexity_per_window"][v] for m in MODELS for v in STREAMS},
        out_dir / "streaming_perplexity.png",
        "position (end of each window of T)",
        "perplexity (bytes)",
    )


def _table(config: Config, rows: list[dict], measured: dict) -> str:
    onset = _common.markdown_table(
        ["width", "layers x heads", "params", "test loss", "largest head mass by step",
         "sink rate (last step)"],
        [[r["width"], f"{r['layers']} x {r['heads']}", f"{r['params']:,}", r["test_loss"],
          ", ".join(f"{h['step']}: {h['max_first_token_mass']:.2f}" for h in r["history"]),
          r["history"][-1]["sink_rate"]] for r in rows],
    )  # fmt: skip
    L = len(measured["mha"]["first_token_mass_per_layer"])
    layers = _common.markdown_table(
        ["layer", *(f"{m} first-token mass" for m in MODELS),
         *(f"{m} largest abs(h) (/ median)" for m in MODELS)],
        [[i, *(float(measured[m]["first_token_mass_per_layer"][i]) for m in MODELS),
          *(f"{measured[m]['massive_top'][i + 1]:.1f} ({measured[m]['massive_ratio'][i + 1]:.0f}x)"
            for m in MODELS)] for i in range(L)],
    )  # fmt: skip
    T = config.base.train.task.seq_len
    stream = _common.markdown_table(
        ["positions", *(f"ppl {m}, {v}" for m in MODELS for v in STREAMS)],
        [[f"{T * k}-{T * (k + 1) - 1}",
          *(float(measured[m]["perplexity_per_window"][v][k]) for m in MODELS for v in STREAMS)]
         for k in range(config.base.stream_factor)],
    )  # fmt: skip
    return "\n".join((onset, layers, stream))


def main(argv=None) -> int:
    return _common.main(NAME, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
