"""``attn.dispatch.CAPABILITIES`` is what ``attn.attention`` does, cell by cell.

For every implementation and every flag of ``attn.dispatch.FLAGS``, the
cheapest call that needs the flag: where the implementation has it, the call
computes dense attention's answer; where it lacks it, the call is refused with
a ``ValueError`` naming the argument (``tests.attn.impls.refusal``). The
kernels run in interpret mode; cuDNN's cells need a GPU, but for its refusal on
a CPU. Mosaic's lacking ``float32`` is its Hopper kernels' refusal (its
interpreted twin takes float32 on a CPU, to check its math at that precision).

Every refusal runs in the fast tier, and so does every call of an implementation
that cannot take the property tests' inputs (Mosaic: bfloat16, head dims 64
and 128). The calls of the others are in the integration tier: in the fast
tier the property tests (which iterate the table) and their own test files run
them with those flags.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks, scores
from attn.dispatch import CAPABILITIES, FLAGS, IMPLS
from tests.attn.impls import SETTINGS, SMALL_FLOAT32, attend, refusal, runs_here
from tests.util import normal, qkv, rel_err

B, T, N = 2, 16, 2


def probe(impl: str, flag: str):
    """``(q, k, v, call_kwargs, settings)``: the cheapest call that needs ``flag`` of ``impl``
    (inputs it takes otherwise: float32 where it has the flag, else bfloat16; head dim 8
    where it takes it, else 64)."""
    caps = CAPABILITIES[impl]
    dtype = jnp.float32 if "float32" in caps else jnp.bfloat16
    H = 8 if "head_dim_8k" in caps else 64
    kw, settings = {}, {}
    if flag == "float32":
        dtype = jnp.float32
        if flag not in caps and "interpret" in SETTINGS.get(impl, {}):
            settings["interpret"] = False  # the compiled kernels' refusal
    elif flag == "head_dim_8k":
        H = 32
    elif flag == "any_head_dim":
        H = 12
    elif flag == "bias":
        kw["bias"] = normal(1, (1, N, T, T), dtype)
    elif flag == "mask_array":
        kw["mask"] = jnp.tril(jnp.ones((T, T), bool))
    elif flag == "score_mod":
        kw |= dict(mask=masks.causal(), score_mod=scores.alibi(scores.alibi_slopes(N)))
    elif flag == "softcap":
        kw["softcap"] = 2.0
    elif flag == "sink":
        kw["sink_logits"] = normal(2, (N,))
    elif flag == "positions":  # each row its own
        positions = jnp.asarray(np.arange(T) + np.array([[0], [3]]), jnp.int32)
        kw |= dict(mask=masks.causal(), q_positions=positions, kv_positions=positions)
    elif flag == "empty_rows_mean":
        kw |= dict(key_value_seq_lengths=jnp.array([0, 5], jnp.int32), empty_rows="mean")
    elif flag in ("return_lse", "return_weights"):
        kw[flag] = True
    q, k, v = qkv(3, B=B, T=T, N=N, H=H, dtype=dtype)
    return q, k, v, kw, settings


def runnable(impl: str, flag: str) -> bool:
    if flag == "cpu":  # every implementation's cell of "cpu" is checked on a CPU
        return jax.default_backend() == "cpu"
    return runs_here(impl)


def cell(impl: str, flag: str):
    caps = CAPABILITIES[impl]
    # The property tests compute these cells' flags; mosaic's interpreted twin (about 1 s a
    # call) computes its own in tests/attn/pallas/test_mosaic.py: theirs run in the
    # integration tier here, every refusal in the fast one.
    computed_elsewhere = flag in caps and (caps >= set(SMALL_FLOAT32) or impl == "mosaic")
    return pytest.param(impl, flag, marks=[pytest.mark.integration] if computed_elsewhere else [])


CELLS = [cell(impl, flag) for impl in IMPLS for flag in FLAGS]


@pytest.mark.parametrize(("impl", "flag"), CELLS)
def test_an_implementation_computes_what_it_has_and_refuses_what_it_lacks(impl, flag):
    if not runnable(impl, flag):
        pytest.skip(f"impl={impl!r} does not run on {jax.default_backend()}")
    q, k, v, kw, settings = probe(impl, flag)
    fn = attend(impl)
    if flag not in CAPABILITIES[impl]:
        if (impl, flag) == ("cudnn", "any_head_dim"):
            # jax.nn's own refusal: attn.attention passes cuDNN the head dims it may take.
            with pytest.raises(NotImplementedError, match="head dim"):
                fn(q, k, v, **kw, **settings)
            return
        with pytest.raises(ValueError, match=refusal(impl, flag)):
            fn(q, k, v, **kw, **settings)
        return
    got = fn(q, k, v, **kw, **settings)
    want = attn.attention(q, k, v, impl="dense", **kw)
    tol = 1e-5 if q.dtype == jnp.float32 else 2e-2
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and rel_err(a, b) <= tol, rel_err(a, b)


def test_the_table_covers_every_implementation_in_one_vocabulary():
    assert set(CAPABILITIES) == set(IMPLS)
    for impl, caps in CAPABILITIES.items():
        assert isinstance(caps, frozenset) and caps <= set(FLAGS), impl
    assert CAPABILITIES["auto"] == CAPABILITIES["dense"] == frozenset(FLAGS)
    # Head dims nest: whoever takes any takes the multiples of 8.
    assert all("head_dim_8k" in caps for caps in CAPABILITIES.values() if "any_head_dim" in caps)
