"""LAPACK's triangular solve deadlocks jaxlib 0.10.1's CPU runtime in PaTH's blockwise backward.

    python tools/repro_jaxlib_0_10_1_path_deadlock.py

What it shows: the compiled gradient of ``attn.path_attention(form="blockwise")``
at T = 256, blocks of 64 (8 heads of 64), run again and again on the same inputs,
with the block's UT form computed as ``path.ut`` first did: one
``jax.scipy.linalg.solve_triangular`` (LAPACK's trsm on the CPU) per block. On
jaxlib 0.10.1 the first run takes 0.1 s and a later one never returns: every
thread waits on a futex, the process at 0% CPU. Neither ``jax.checkpoint`` on the
query-block body nor the ``lax.cond`` that skips later key blocks is the cause
(the hang stays without either), nor XLA's thunk runtime, async dispatch or
multi-threaded Eigen (flags off: it stays). At T = 64 (two blocks) it does not
hang. The library's ``path.ut`` now inverts with matmuls
(``attn.linear.delta_forms.unit_lower_inverse``, written for the same hang in
the delta rule's backward): without this script's patch all 8 runs finish.

Seen on: jaxlib 0.10.1 (hangs; the CPU of the suite's pin), 0.11.2 (all runs
finish, also at T = 1024 with blocks of 32 and 128), x86_64 Linux, 2 cores.

The program runs in a child process so that this script reports the hang instead
of hanging; it exits 1 when the child did not finish in 60 s, 0 when it did.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import jax, jax.numpy as jnp, numpy as np
from jax.scipy.linalg import solve_triangular
import attn
from attn.softmax import path

def lapack_ut(w, beta, k=None):  # path.ut as it was: LAPACK's triangular solve
    C, H = w.shape[-2:]
    strict = np.tril(np.ones((C, C), bool), -1)
    bw = beta[..., None] * w
    a = jnp.eye(C, dtype=w.dtype) + jnp.where(strict, jnp.einsum("...th,...sh->...ts", bw, w), 0)
    rhs = [bw]
    if k is not None:
        rhs.append(jnp.where(strict, jnp.einsum("...th,...jh->...tj", bw, k), 0))
    y = solve_triangular(a, jnp.concatenate(rhs, -1), lower=True, unit_diagonal=True)
    return y[..., :H], (y[..., H:] if k is not None else None)

path.ut = lapack_ut
B, T, N, H = 1, 256, 8, 64
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32) for _ in range(3))
w = rng.standard_normal((B, T, N, H))
w = jnp.asarray(w / np.linalg.norm(w, axis=-1, keepdims=True), jnp.float32)
beta = jnp.asarray(rng.uniform(0, 2, (B, T, N)), jnp.float32)
def loss(*xs):
    return jnp.sum(attn.path_attention(*xs, form="blockwise", block_size=64) ** 2)
grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
for i in range(8):
    jax.block_until_ready(grad(q, k, v, w, beta))
    print("run", i, "done", flush=True)
"""


def main() -> int:
    try:
        run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out.strip() or "(no run finished)")
        print("deadlocked: the child did not finish in 60 s")
        return 1
    print(run.stdout.strip(), run.stderr.strip()[-500:], sep="\n")
    return 0 if run.returncode == 0 else 2


if __name__ == "__main__":
    sys.exit(main())
