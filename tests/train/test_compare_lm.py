"""Language modelling as a comparison (``python -m train.compare --task bytes``,
``configs/compare_lm.py``): the config the command line picks, a tiny run end to end in
bits per byte with a second seed and test lengths, and the committed run."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from configs.compare_mqar import get_config
from train import compare
from train.cli import load_config
from train.compare import run_comparison
from train.compare_report import write_results

REPO = Path(__file__).resolve().parents[2]


def test_quick_with_another_scale_is_refused_not_replaced():
    """--quick is one size: with --scale gpu it planned the quick runs, silently."""
    from configs import recall_frontier

    with pytest.raises(ValueError, match=r"^scale: expected 'cpu' with --quick .*got 'gpu'$"):
        compare._parse(["--task", "bytes", "--quick", "--scale", "gpu"])
    with pytest.raises(ValueError, match=r"^scale: expected 'cpu' with --quick .*got 'gpu'$"):
        recall_frontier.get_config(quick=True, scale="gpu")
    assert recall_frontier.get_config(quick=True).name == "quick"


def test_the_small_scale_is_each_comparison_in_five_minutes():
    """``--scale small`` (docs/results/README.md ranks it against the full runs): the recall
    comparison's every run, each the first steps of its full run; the English one's every
    variant and 2 seeds at one rate, half the width, depth and context."""
    full, small = compare._parse([]), compare._parse(["--scale", "small"])
    assert (small.variants, small.seeds, small.name) == (full.variants, full.seeds,
                                                         "compare_mqar_small")  # fmt: skip
    assert small.train.steps < full.train.steps == small.train.optim.decay_steps
    assert dataclasses.replace(small.train, steps=full.train.steps, optim=full.train.optim) == (
        full.train
    )
    english = REPO / "configs" / "compare_lm_english.py"
    small = load_config(english, scale="small")
    full = load_config(english)
    assert small.variants == full.variants and small.name == "compare_lm_english_small"
    assert (small.seeds, small.lrs, small.best_lr_seeds, small.edge_lrs) == ((0, 1), (1e-2,), (), 0)
    assert (small.train.model.width, small.num_layers, small.train.task.seq_len) == (64, 2, 128)
    assert small.train.task.data == "shakespeare" and small.match_params == "mha"


@pytest.mark.integration  # the fast tier's 4 minutes are full
def test_task_bytes_is_the_language_modelling_config():
    # One build of the full config (matching 12 variants' sizes costs seconds); the quick
    # one is compared with the file's in test_bytes_reports_bits_per_byte.
    lm = compare._parse(["--task", "bytes"])
    assert lm.name == "compare_lm" and lm.train.task.seq_len == 256
    assert compare._parse(["--task", "bytes", "--quick"]).name == "compare_lm_quick"
    assert compare._parse(["--task", "induction"]).name == "compare_induction"
    # The comparison a paper prints: matched sizes, two rates then a second seed, and
    # every kind (the matching itself is checked when the config is built).
    assert lm.match_params == "mha" and len(lm.lrs) == 2 and lm.best_lr_seeds == (1,)
    assert {"alibi", "fox", "streaming", "mamba2", "moba", "based"} <= set(lm.variants)
    assert lm.test_lengths == (1, 2, 4, 8) and lm.train.task.bos
    with pytest.raises(ValueError, match="task: expected 'bytes'"):
        load_config(REPO / "configs" / "compare_lm.py", task="mqar")


@pytest.mark.integration
def test_the_gpu_scale_is_sized_to_eight_minutes_on_an_h200(capsys):
    """``--scale gpu``: tens of millions of parameters at T = 1024, bf16 compute with float32
    parameters, predicted within 8 minutes by ``--dry-run`` (shapes only, nothing trains);
    the recall frontier's gpu scale likewise."""
    assert compare.main(["--task", "bytes", "--scale", "gpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    seconds = float(out.split("predicted ")[1].split(" s on one NVIDIA H200")[0])
    assert seconds <= 480 and "| mha | 33.7M |" in out
    gpu = compare._parse(["--task", "bytes", "--scale", "gpu"])
    model = gpu.train.model
    assert (model.width, gpu.num_layers, gpu.train.task.seq_len) == (512, 8, 1024)
    assert (model.dtype, model.param_dtype, gpu.name) == ("bfloat16", "float32", "compare_lm_gpu")
    with pytest.raises(ValueError, match=r"^scale: expected 'cpu' or 'small', got 'gpu'$"):
        compare._parse(["--scale", "gpu"])
    with pytest.raises(ValueError, match=r"^--scale: .*mqar\.py' has one scale"):
        load_config(REPO / "configs" / "mqar.py", scale="gpu")
    from analysis.experiments import recall_frontier_grid as grid

    scale = grid.SCALES["gpu"]
    frontier = grid.dry_run(scale)
    assert frontier["gpu_seconds"] <= 480 and frontier["runs"] == 24
    float32 = dataclasses.replace(scale, dtype="float32")
    for p in frontier["points"][:2]:  # bf16 compute; the state still counted at float32
        point = ((128, 8), p["family"], p["knob"])
        assert p["state_elements"] == grid.sizes(float32, point)["state_elements"]
    assert grid.train_config(scale, grid.runs(scale)[0]).model.dtype == "bfloat16"


@pytest.mark.integration
def test_bytes_reports_bits_per_byte(tmp_path):
    """``--task bytes``: the config's bytes comparison, tiny, on a small corpus."""
    corpus = tmp_path / "corpus"  # two files: one piece for each split (train.tasks)
    corpus.mkdir()
    for name, line in (("a.txt", "the quick brown fox. "), ("b.txt", "jumps over the dog. ")):
        (corpus / name).write_text(line * 50)
    config = get_config(task="bytes", quick=True)  # compare_mqar's --task bytes: compare_lm's
    assert config == load_config(REPO / "configs" / "compare_lm.py", quick=True)
    assert config.train.task.name == "bytes" and config.train.target_accuracy is None
    train_config = dataclasses.replace(
        config.train,
        task=dataclasses.replace(config.train.task, seq_len=16, data=str(corpus)),
        model=dataclasses.replace(config.train.model, width=16),
        steps=4,
        batch_size=4,
        eval_every=2,
        eval_batches=2,
    )
    config = dataclasses.replace(
        config,
        train=train_config,
        variants=("mha",),
        seeds=(0,),
        best_lr_seeds=(1,),  # a second wave: seed 1 at the sweep's best rate only
        test_lengths=(1, 2),  # every final model also tested on windows of 2T
        lrs=(3e-3, 3e-2),
        num_heads=2,
        gqa_kv_heads=1,
        results_dir=str(tmp_path / "results"),
        runs_dir=str(tmp_path / "runs"),
        jobs=1,
        progress=False,
    )
    results = run_comparison(config)
    folder, paths = write_results(results, config)
    assert results["metric"] == "bits_per_byte" and results["chance_accuracy"] is None
    v = results["variants"]["mha"]
    sweep, (second,) = results["runs"][:2], results["runs"][2:]
    assert [(r["lr"], r["seed"]) for r in sweep] == [(3e-3, 0), (3e-2, 0)]
    bits = {r["lr"]: r["summary"]["test_loss"] / math.log(2) for r in sweep}
    assert v["lr"] == min(bits, key=bits.get) == second["lr"] and second["seed"] == 1
    assert v["seeds"] == [0, 1] and v["bits_per_byte"]["count"] == 2
    at_best = [r for r in results["runs"] if r["lr"] == v["lr"]]
    want = np.mean([r["summary"]["test_loss"] for r in at_best]) / math.log(2)
    assert v["bits_per_byte"]["mean"] == pytest.approx(want)
    assert v["metric_per_lr"][f"{v['lr']:g}"] == pytest.approx(bits[v["lr"]])  # seed 0 only
    assert v["steps_run"]["mean"] == 4  # no target on bytes: every run trains to its cap
    line = compare._done_line("[1/3] mha", {"test_loss": 2.5 * math.log(2), "step": 4,
                                            "wall_s": 3.0}, True)  # fmt: skip
    assert line == "[1/3] mha: test bits/byte 2.500 at step 4, 3 s"
    diverged = {"test_accuracy": 0.0, "test_loss": None, "step": 7}  # _train_one's stand-in
    assert compare._done_line("[2/3] mha", diverged, True) == "[2/3] mha: diverged at step 7"
    table = (folder / "table.md").read_text()
    assert "| final bits/byte | test SE | final test accuracy | steps run |" in table
    se = [r["summary"]["test_loss_se"] / math.log(2) for r in at_best]  # eval_batches = 2
    assert v["bits_per_byte_se"]["mean"] == pytest.approx(np.mean(se)) and min(se) > 0
    bpb = v["bits_per_byte"]
    assert f"| {bpb['mean']:.3f} ({bpb['min']:.3f}-{bpb['max']:.3f}) |" in table  # 2 seeds
    assert "seeds 0 (the sweep), 1 (at the best rate)" in table
    assert "at the variant's best learning rate of the sweep (picked on seed 0)" in table
    # Train short, test long: at 1x the run's own last evaluation; at 2x the same tokens.
    for run in results["runs"]:
        one, two = run["lengths"]["1"], run["lengths"]["2"]
        assert one["test_loss"] == pytest.approx(run["summary"]["test_loss"], rel=1e-6)
        assert (one["seq_len"], one["windows"], two["seq_len"], two["windows"]) == (16, 8, 32, 4)
    twice = [r["lengths"]["2"]["test_loss"] / math.log(2) for r in at_best]
    assert v["at_length"]["2"]["mean"] == pytest.approx(np.mean(twice))
    assert "## Train short, test long" in table and "| 2x (T=32) |" in table
    # Every output in the task's own terms: bits per byte on both panels, lower is better.
    assert [p.name for p in paths] == ["table.md", "results.json", "bits_vs_state.png",
                                       "curves.png", "lengths.png"]  # fmt: skip
    from train.compare_plots import curves_figure, recall_vs_state_figure

    fig, ax, _ = recall_vs_state_figure(results)
    assert ax.get_ylabel() == "final test bits per byte (lower is better)"
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > bpb["max"]  # the full range
    assert len(ax.containers) == 1  # the error bar of mha's two seeds
    curves = curves_figure(results)
    assert [a.get_ylabel().split(" (")[0] for a in curves.axes] == [
        "train bits per byte", "test bits per byte"
    ]  # fmt: skip
    best_seed0 = next(r for r in sweep if r["lr"] == v["lr"])  # the solid line
    train_bits = np.asarray(curves.axes[0].lines[0].get_ydata())
    np.testing.assert_allclose(train_bits * math.log(2), best_seed0["curves"]["train_loss"])
    import matplotlib.pyplot as plt

    plt.close(fig)
    plt.close(curves)


def test_every_variant_has_its_own_color():
    from train.compare_plots import variant_colors

    for n in (3, 10, 12, 20, 25):  # the language-modelling comparison has 12
        colors = variant_colors(n)
        assert len(colors) == n and len({tuple(c) for c in colors}) == n


def test_the_committed_language_modelling_run_is_the_one_the_issue_asks_for():
    results = json.loads((REPO / "docs/results/compare_lm/results.json").read_text())
    config = results["config"]
    assert results["metric"] == "bits_per_byte" and results["wall_s"] < 3600
    variants = results["variants"]
    reference = variants["mha"]["params"]
    for name, v in variants.items():
        assert abs(v["params"] - reference) <= 0.02 * reference, name
        assert v["seeds"] == [0, 1] and len(v["metric_per_lr"]) == 2, name
        assert v["bits_per_byte"]["count"] == 2 and v["bits_per_byte_se"]["mean"] > 0, name
        assert sorted(v["at_length"], key=int) == ["1", "2", "4", "8"], name
    assert len(results["runs"]) == len(variants) * 3  # 2 rates on seed 0, seed 1 at the best
    assert config["train"]["task"]["seq_len"] == 256 and config["match_params"] == "mha"
    # The lengths figure tells all twelve apart.
    from train.compare_plots import lengths_figure

    lines = lengths_figure(results).axes[0].containers
    assert len({tuple(c.lines[0].get_color()) for c in lines}) == len(variants) == 12


def test_the_committed_english_run_tells_its_variants_apart():
    """docs/results/compare_lm_english: within the hour; every variant's test estimate at most
    half its seeds' spread; every best rate inside the rates it tried (the edge widened)."""
    results = json.loads((REPO / "docs/results/compare_lm_english/results.json").read_text())
    config = results["config"]  # the run's: Shakespeare, a larger final evaluation, the edge
    assert results["wall_s"] < 3600 and config["train"]["task"]["data"] == "shakespeare"
    assert config["train"]["task"]["val_percent"] == 15 and config["match_params"] == "mha"
    assert config["train"]["final_eval_batches"] == 128 > config["train"]["eval_batches"]
    assert (config["edge_lrs"], config["edge_ratio"], len(results["variants"])) == (1, 3.0, 8)
    for name, v in results["variants"].items():
        bpb, se = v["bits_per_byte"], v["bits_per_byte_se"]["mean"]
        assert bpb["count"] == 2 and 0 < se <= (bpb["max"] - bpb["min"]) / 2, name
        rates = sorted(float(r) for r in v["metric_per_lr"])
        assert len(rates) == 3 and rates[0] < v["lr"] < rates[-1], name
        assert sorted(v["at_length"], key=int) == ["1", "2", "4", "8"], name
