"""The smallest program we found that crashes jaxlib 0.10.2 on CPU (segfault).

    python tools/repro_jaxlib_0_10_2_segfault.py

What it shows: a jitted multiply-reduce, ``sum(y[..., None] * x, axis=-2)`` on a
rank-7 ``x`` with a unit axis and at least three larger axes in front of it.
jaxlib 0.10.2's CPU backend offloads such a fusion (broadcast, multiply,
reduce) to YNNPACK, whose transpose step (``slinky::fuse_contiguous_dims``)
dereferences a bad pointer; jaxlib 0.10.1 keeps it in XLA's own loop emitter
and runs it fine. The order matters: ``x * y[..., None]`` does not crash, nor
do the same shapes without the unit axis, nor shapes with fewer elements.

Where we met it: the backward pass of the Taylor feature map
``x (x) x`` (``attn.linear.taylor``) when it was formed on the chunkwise layout
``[n,B,K,G,C,H]`` with G == 1 (multi-head attention): the gradient of the outer
product is exactly this multiply-reduce. ``attn.linear`` now forms the outer
product on rows ``[M, H]``, whose gradient is a rank-3 reduce.

Seen on: jax/jaxlib 0.10.2 (crashes, exit code -11), 0.10.1 (prints the shape),
x86_64 Linux. On 0.10.2 the crash goes away with
``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot`` (YNNPACK for matmuls
only), which shows the culprit but is not something a library should set for
its users.

The program runs in a child process so that this script reports the crash
instead of dying of it; it exits 1 when the child crashed, 0 when it did not.
"""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import jax, jax.numpy as jnp
x = jnp.ones((2, 2, 4, 1, 16, 4, 4))
y = jnp.ones((2, 2, 4, 1, 16, 4))
print(jax.jit(lambda x, y: jnp.sum(y[..., None] * x, axis=-2))(x, y).shape)
"""


def main() -> int:
    import jax
    import jaxlib

    child = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True)
    versions = f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"
    if child.returncode == 0:
        print(f"{versions}: ran fine, output shape {child.stdout.strip()}")
        return 0
    print(f"{versions}: the child crashed with exit code {child.returncode}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
