"""The torch side of ``bench/_device_families.py``: fla's Triton kernels as the peer.

fla (flash-linear-attention, github.com/fla-org/flash-linear-attention) is a
benchmark peer: it is run, never imported by the library, never committed.
``tools/fla_peer.sh`` copies its ``fla`` package into ``.peers/fla/`` (git-ignored)
with the commit in ``.peers/fla/COMMIT``; the device run carries that folder and
passes it as ``Context.fla_path``.

Loading. fla's top-level ``__init__`` imports ``fla.layers`` and ``fla.models``
(transformers), ``fla.ops``'s imports every op, and ``fla.modules``'s every
layer module. None of the three runs: bare package modules are registered for
them, their ``__path__`` set to the copied source, so ``import fla.ops.kda``
runs only that package's ``__init__`` and what it imports (``fla.utils``,
``fla.ops.utils``, ``fla.ops.common``, ``fla.modules.l2norm``, ...: torch,
triton, einops and packaging). ``fla.__version__`` is read from its
``__init__`` (``fla.utils`` imports it).

The ops, each called on our very inputs (host copies of the device arrays, bf16 as its
bits, moved back to the GPU: q, k, v and beta bf16, the gates float32, as fla's own
tests give them), with fla's default chunk of 64 (ours is 64):

* ``linear``: ``fla.ops.linear_attn.chunk_linear_attn(q, k, v, scale, normalize=False)``
  (which is ``chunk_simple_gla`` without a gate);
* ``deltanet``: ``fla.ops.delta_rule.chunk_delta_rule(q, k, v, beta, scale)``;
* ``gated_deltanet``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta,
  scale)``;
* ``kda``: ``fla.ops.kda.chunk_kda(q, k, v, g, beta, scale, safe_gate=True,
  lower_bound=-5)``: the gate given in log space, not computed in the kernel; ``safe_gate``
  is the faster path fla's own benchmark registry times, the same function for gates in
  [-5, 0), which ours are (-0.1 to -0.001);
* ``deltaproduct``: ``fla.ops.gated_delta_product.chunk_gated_delta_product(q, k, v, g,
  beta, num_householder=n, scale)``, k, v and beta flattened to ``T n`` steps, token-major
  (our ``[B,T,n,...]`` layout, reshaped);
* ``ssd``: ``fla.ops.simple_gla.chunk_simple_gla(q=C, k=B, v=dt x, g=dt A, scale=1)``
  plus ``D x``: Mamba-2's SSD as the scalar-gated linear attention it is; B and C
  (one group) expanded to the heads, as our ``attn.ssd`` repeats them. Where it
  differs: ``dt x`` is rounded to bf16 before the kernel (fla takes v in q's dtype);
  ours keeps it in float32;
* ``dplr``: ``fla.ops.generalized_delta_rule.chunk_dplr_delta_rule(q, k, v, a, b,
  gk=log_w, scale=1.0, safe_gate=True)`` (what ``fla.ops.rwkv7.chunk_rwkv7`` calls), our
  ``attn.dplr_delta_rule`` exactly: fla's ``S (diag(w) + a b^T) + v k^T`` on its ``[V, K]``
  state is ours transposed, ``a`` reading and ``b`` writing in both. RWKV-7's inputs
  (``a = -kappa``, ``b = kappa * a_in``, ``log_w`` in (-0.6, 0), the ``[-5, 0)`` that
  ``safe_gate`` asks, scale 1); fla's chunks are 16 (``safe_gate`` allows no other), ours 64;
* ``path``: ``fla.ops.path_attn.parallel_path_attn(q, k, v, w, beta, g, scale)`` (w, beta
  and g float32, as it asserts): PaTH-FoX. fla adds the gate's sums inside the scaled
  logit (``scale * (q^T P k + c_i - c_j)``), ours beside it, so ours is called with
  ``log_forget = scale * g``: the same function of the same inputs, gradients included;
* ``log_linear``: ``fla.ops.log_linear_attn.chunk_log_linear_attn(q, k, v, g,
  level_scales)``: log-linear Mamba-2 (one group of B and C, fla's only layout; no scale)
  with ``L = bit_length(T - 1) + 1`` levels, every level its own weight (fla reads that
  many); ours is ``attn.log_linear_attention(..., scale=1.0)``, chunks of 64 both;
* ``mesa_net``: ``fla.ops.mesa_net.chunk_mesa_net(q, k, v, g, beta, lamb,
  max_CG_iteration=30)``, our ``attn.mesa_net(..., cg_steps=30)`` exactly (the same CG from
  zero with the same 1e-5 in both denominators, scale 1, chunks of 64; the implicit
  gradient in both). Where it differs: fla keeps its per-chunk states in bf16
  (``states_in_fp32=False``), ours float32;
* ``ttt_linear``: ``fla.ops.ttt.chunk_ttt_linear(q, k, v, w, b, eta[..., None], scale,
  chunk_size=16)``: NOT our function (it scales q, reads ``o + LN(o)`` where the authors
  read ``q + LN(o)``, and applies each token's rate differently): a timing reference only,
  never compared;
* ``nsa``: ``fla.ops.nsa.parallel_nsa(q, k, v, g_cmp, g_slc, block_counts,
  block_size, window_size=0)``: NOT our function (its compression is a mean over
  blocks of ``block_size``, ours is given overlapping blocks, and it has no window
  branch here, which would need flash-attn): a timing reference only, never compared.

Triton's cache. Unless ``TRITON_CACHE_DIR`` is set, it is ``triton-cache`` beside the
fla folder (``.peers/triton-cache``, git-ignored): fla's kernels autotune with
``cache_results``, so the ``*.autotune.json`` files there spare a later run on the same
GPU and image the tuning (tens of seconds per op on a fresh machine), if they are brought
back and carried again.

Timing, as ours: the wall time of a call followed by ``torch.cuda.synchronize()``,
the best of ``repeats`` runs after a warm-up (``best_seconds``). The first call,
which compiles fla's kernels and runs Triton's autotuning, is timed apart
(``first_call_seconds``). Forward + backward is ``out.backward(ct)`` with every
input in ``names[:n_diff]`` requiring a gradient, the gradients cleared before
each run. Where torch, a CUDA device, triton or the fla source is missing, the
peer is ``"not measured: <why>"``.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import time
import types
from pathlib import Path

import numpy as np

from bench._device_common import best_seconds

# family -> (module, function) of fla.
OPS = {
    "linear": ("fla.ops.linear_attn", "chunk_linear_attn"),
    "deltanet": ("fla.ops.delta_rule", "chunk_delta_rule"),
    "gated_deltanet": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "kda": ("fla.ops.kda", "chunk_kda"),
    "deltaproduct": ("fla.ops.gated_delta_product", "chunk_gated_delta_product"),
    "ssd": ("fla.ops.simple_gla", "chunk_simple_gla"),
    "nsa": ("fla.ops.nsa", "parallel_nsa"),
    "dplr": ("fla.ops.generalized_delta_rule", "chunk_dplr_delta_rule"),
    "path": ("fla.ops.path_attn", "parallel_path_attn"),
    "log_linear": ("fla.ops.log_linear_attn", "chunk_log_linear_attn"),
    "ttt_linear": ("fla.ops.ttt", "chunk_ttt_linear"),
    "mesa_net": ("fla.ops.mesa_net", "chunk_mesa_net"),
}
# Packages whose __init__ is not run (see the module docstring).
BARE = ("fla", "fla.ops", "fla.modules")
SAMPLE = 1 << 21  # elements of each tensor compared (of its first batch row)
# An op's first call compiles its kernels and autotunes them (tens of seconds on a fresh
# machine): it is not started with less of the phase's time left than this (a phase's
# child is stopped 45 s past its share, bench/device.py's GRACE_SECONDS).
FIRST_CALL_SECONDS = 45.0
DEVICE = "cuda"  # where the peer runs (a test may run a stand-in fla on the CPU)
TRITON_CACHE = "triton-cache"  # Triton's cache dir, a sibling of the fla folder (.peers/...)


class Unavailable(Exception):
    """Why the peer cannot be measured here."""


_loaded: dict = {}  # the process's one load: {"path", "info"} or {"path", "error"}
_called: set = set()  # the families whose op has run in this process (compiled, tuned)


def load(fla_path: str | None) -> dict:
    """Makes ``fla.ops.*`` importable from ``fla_path`` (once per process).

    Returns ``{"version", "commit", "torch", "triton"}``; raises ``Unavailable``.
    """
    if _loaded:
        if _loaded["path"] != fla_path:
            raise Unavailable(f"fla was loaded from {_loaded['path']} in this process")
        if "error" in _loaded:
            raise Unavailable(_loaded["error"])
        return _loaded["info"]
    _loaded["path"] = fla_path
    try:
        info = _load(fla_path)
    except Unavailable as e:
        _loaded["error"] = str(e)
        raise
    _loaded["info"] = info
    return info


def _load(fla_path: str | None) -> dict:
    try:
        import torch
    except ImportError:
        raise Unavailable("torch is not installed") from None
    except Exception as e:  # a CUDA library that does not load beside jax's, say
        raise Unavailable(f"torch does not import: {type(e).__name__}: {e}"[:300]) from None
    if not torch.cuda.is_available():
        raise Unavailable("torch sees no CUDA device")
    if not fla_path:
        raise Unavailable("no fla source (tools/fla_peer.sh prepares .peers/fla)")
    root = Path(fla_path) / "fla"
    if not (root / "ops").is_dir():
        raise Unavailable(f"no fla package in {fla_path}")
    # Triton's kernels and fla's autotuning results (cache_results) beside the source, so
    # that they can travel with it: a later run on the same GPU and image skips the tuning.
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(fla_path).resolve().parent / TRITON_CACHE))
    try:
        import triton
    except ImportError:
        raise Unavailable("triton is not installed") from None
    if "fla" in sys.modules and list(getattr(sys.modules["fla"], "__path__", [])) != [str(root)]:
        raise Unavailable("another fla is imported in this process")
    info = {
        "version": fla_version(root / "__init__.py"),
        "commit": fla_commit(fla_path),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    for name in BARE:
        if name in sys.modules:
            continue
        module = types.ModuleType(name)
        module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        module.__package__ = name
        if name == "fla":
            module.__version__ = info["version"]
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return info


def fla_version(init: Path) -> str:
    """``__version__`` as fla's ``__init__`` sets it (the file is not run)."""
    found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", init.read_text(), re.M)
    return found.group(1) if found else "unknown"


def fla_commit(fla_path) -> str:
    """The commit ``tools/fla_peer.sh`` recorded in ``<fla_path>/COMMIT``, or ``"unknown"``."""
    path = Path(fla_path) / "COMMIT"
    text = path.read_text().split() if path.is_file() else []
    return text[0] if text else "unknown"


def op(family: str):
    """fla's function for ``family`` (``OPS``), imported from the loaded source."""
    module, name = OPS[family]
    return getattr(importlib.import_module(module), name)


def op_name(family: str) -> str:
    module, name = OPS[family]
    return f"{module}.{name}"


def call(family: str, item: dict):
    """``f(t) -> out``: fla's op on the tensors ``t`` (a dict by our argument names)."""
    fn = op(family)
    scale = item["H"] ** -0.5
    if family == "linear":
        return lambda t: fn(t["q"], t["k"], t["v"], scale=scale, normalize=False)[0]
    if family == "deltanet":
        return lambda t: fn(t["q"], t["k"], t["v"], t["beta"], scale=scale)[0]
    if family == "gated_deltanet":
        return lambda t: fn(t["q"], t["k"], t["v"], t["g"], t["beta"], scale=scale)[0]
    if family == "kda":
        return lambda t: fn(
            t["q"], t["k"], t["v"], t["g"], t["beta"], scale=scale, safe_gate=True, lower_bound=-5.0
        )[0]
    if family == "deltaproduct":

        def steps(x):  # [B,T,n,...] -> [B,T*n,...], token-major
            return x.flatten(1, 2)

        return lambda t: fn(
            t["q"],
            steps(t["k"]),
            steps(t["v"]),
            t["g"],
            steps(t["beta"]),
            num_householder=item["n"],
            scale=scale,
        )[0]
    if family == "ssd":

        def ssd(t):
            x, dt = t["x"], t["dt"]
            N, H = x.shape[2], t["B"].shape[-1]
            heads = (-1, -1, N, H)  # one group of B and C, read by every head
            v = (x.float() * dt[..., None]).to(x.dtype)
            g = dt * t["A"]
            y, _ = fn(t["C"].expand(heads), t["B"].expand(heads), v, g=g, scale=1.0)
            return (y.float() + t["D"][:, None] * x.float()).to(x.dtype)

        return ssd
    if family == "nsa":
        return lambda t: fn(
            t["q"],
            t["k"],
            t["v"],
            t["gates"][..., 0],
            t["gates"][..., 1],
            block_counts=item["num_selected"],
            block_size=item["select_block"],
            window_size=0,
            scale=scale,
        )
    if family == "dplr":
        return lambda t: fn(
            t["q"], t["k"], t["v"], t["a"], t["b"], t["log_w"], scale=1.0, safe_gate=True
        )[0]
    if family == "path":
        return lambda t: fn(t["q"], t["k"], t["v"], t["w"], t["beta"], g=t["g"], scale=scale)[0]
    if family == "log_linear":
        return lambda t: fn(t["q"], t["k"], t["v"], t["g"], t["level_scales"])[0]
    if family == "ttt_linear":  # eta per token as [B,T,N,1]; mini-batches of 16 both
        return lambda t: fn(t["q"], t["k"], t["v"], t["w"], t["b"], t["eta"][..., None],
                            scale=scale, chunk_size=16)[0]  # fmt: skip
    if family == "mesa_net":
        return lambda t: fn(t["q"], t["k"], t["v"], t["g"], t["beta"], t["lamb"],
                            max_CG_iteration=30)[0]  # fmt: skip
    raise KeyError(family)


def sample(x) -> np.ndarray:
    """The first ``SAMPLE`` elements of ``x``'s first batch row, float32 on the host."""
    flat = x.detach()[:1].reshape(-1)[:SAMPLE]
    return flat.float().cpu().numpy()


def measure(family, item, arrays, dtypes, names, n_diff, ct, mode, ctx, max_seconds) -> tuple:
    """Times fla's op for ``family`` on ``arrays``: ``(row, values)``.

    ``arrays``: host copies of our inputs by name, bf16 ones as their bits (``uint16``),
    in the order of ``names`` (the first ``n_diff`` get gradients); ``dtypes``: each
    one's dtype name; ``ct``: the output's cotangent (bf16 bits), for ``mode ==
    "fwd+bwd"``. ``row`` is JSON-able (status, ms, first_call_seconds, the op and fla's
    version); ``values``: ``{"out": ..., name: grad}`` samples (``sample``) to compare
    with ours, empty unless measured.
    """
    row = {"op": f"fla {op_name(family)}"}
    try:
        info = load(ctx.fla_path)
    except Unavailable as e:
        return dict(row, status=f"not measured: {e}"), {}
    row["fla"] = info
    if ctx.left() <= (0 if family in _called else FIRST_CALL_SECONDS):
        why = "" if family in _called else " (fla's first call compiles and autotunes)"
        return dict(row, status=f"not measured: time budget{why}"), {}
    import torch

    try:
        fn = call(family, item)
    except Exception as e:  # an fla module that does not import here
        return dict(row, status=f"not measured: importing fla: {type(e).__name__}: {e}"[:300]), {}
    grads = mode == "fwd+bwd"

    def tensor(a, dtype):
        x = torch.from_numpy(np.ascontiguousarray(a))
        if dtype == "bfloat16":  # its bits (NumPy has no bf16)
            x = x.view(torch.bfloat16)
        return x.to(DEVICE)

    t = {name: tensor(arrays[name], dtypes[name]) for name in names}
    leaves = [t[name].requires_grad_(True) for name in names[:n_diff]] if grads else []
    cot = tensor(ct, "bfloat16") if grads else None
    held = {}

    def run():
        if grads:
            for x in leaves:
                x.grad = None
            out = fn(t)
            out.backward(cot.to(out.dtype))
        else:
            with torch.no_grad():
                out = fn(t)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        held["out"] = out

    try:
        start = time.perf_counter()
        run()
        row["first_call_seconds"] = time.perf_counter() - start
        _called.add(family)
        seconds = best_seconds(run, ctx.repeats, max_seconds)
        values = {"out": sample(held["out"])}
        for name in names[:n_diff] if grads else ():
            if t[name].grad is not None:
                values[name] = sample(t[name].grad)
        row.update(status="ok", ms=seconds * 1e3)
        return row, values
    finally:  # the device memory goes back before our next program
        held.clear()
        t.clear()
        leaves.clear()
        cot = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
