"""bench/attention.py's child process: one measurement (time, then peak memory) per process.

``bench/attention.py`` runs itself as the child (``measure``, with the spec in
``ATTN_BENCH_CHILD``) and calls ``child_main`` there. JAX, torch and ``attn``
are imported inside the functions: with ``--scores --baseline-root`` the child
puts an earlier checkout on ``sys.path`` first, and its ``attn`` must be the
one imported.
"""

from __future__ import annotations

import os
import sys
import time

SINGLE_RUN_SECONDS = 3.0  # a run this long is timed once


def child_main(spec: dict) -> dict:
    """Runs one measurement in this (child) process and returns its result."""
    if spec["platform"]:
        os.environ["JAX_PLATFORMS"] = spec["platform"]
    if spec.get("kind") == "scores":
        from bench._scores import time_scores  # before an earlier checkout shadows `bench`

        if spec.get("root"):  # an earlier checkout's attn (a before/after run)
            sys.path.insert(0, spec["root"])
        return time_scores(spec)
    if spec["impl"] == "platform":  # which backend JAX picks; the parent never starts one
        import jax

        return {"platform": jax.default_backend()}
    if spec["impl"] == "torch":
        seconds = _time_torch(spec)
    elif spec["impl"] == "matmul":
        seconds = _time_matmul(spec)
    else:
        seconds = _time_jax(spec)
    result = {"seconds": seconds, "peak_rss_bytes": _peak_rss_bytes()}
    if spec["platform"] not in ("cpu", "") and spec["impl"] != "torch":
        import jax

        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            result["peak_device_bytes"] = stats["peak_bytes_in_use"]
        if "bytes_limit" in stats:
            result["device_bytes_limit"] = stats["bytes_limit"]
    return result


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource  # not Linux: ru_maxrss (KiB on Linux, bytes on macOS)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _best_of(run, repeats: int) -> float:
    times = []
    while len(times) < repeats:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        if times[-1] > SINGLE_RUN_SECONDS:
            break
    return min(times)


def _inputs(spec: dict):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (spec["batch"], spec["T"], spec["heads"], spec["head_dim"])
    return [rng.standard_normal(shape, np.float32) for _ in range(4)]  # q, k, v, cotangent


def _time_matmul(spec: dict) -> float:
    import jax
    import jax.numpy as jnp

    n = spec["T"]
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), spec["dtype"])
    dot = jax.jit(jnp.dot).lower(a, a).compile()
    jax.block_until_ready(dot(a, a))
    return _best_of(lambda: jax.block_until_ready(dot(a, a)), spec["repeats"])


def _time_jax(spec: dict) -> float:
    import jax
    import jax.numpy as jnp

    import attn
    from attn import masks
    from attn.softmax.blockwise import blockwise_attention

    causal = spec["mask"] == "causal"
    if spec["impl"] == "tiles":
        fn = _tile_matmuls(spec, causal)
    elif spec["impl"] in ("xla", "cudnn"):

        def fn(q, k, v):
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation=spec["impl"]
            )

    else:
        call = blockwise_attention if spec["impl"] == "blockwise" else attn.dot_product_attention
        mask = masks.causal() if causal else masks.full()

        def fn(q, k, v):
            return call(q, k, v, mask=mask)

    q, k, v, ct = (jnp.asarray(x, spec["dtype"]) for x in _inputs(spec))
    if spec["mode"] == "fwd":
        step, args = fn, (q, k, v)
    else:

        def step(q, k, v, ct):
            return jax.grad(lambda q, k, v: (fn(q, k, v) * ct).sum(), argnums=(0, 1, 2))(q, k, v)

        args = (q, k, v, ct)
    compiled = jax.jit(step).lower(*args).compile()
    run = lambda: jax.block_until_ready(compiled(*args))  # noqa: E731
    start = time.perf_counter()
    run()  # the first run warms up (allocations, threads); timed for long runs
    first = time.perf_counter() - start
    if first > SINGLE_RUN_SECONDS:
        return first
    return _best_of(run, spec["repeats"])


def _tile_matmuls(spec: dict, causal: bool):
    """The two matmuls of every tile blockwise's forward pass computes, and nothing else.

    The same tile shapes (one kv head per tile at the default block sizes,
    ``[X,Q,H] @ [X,H,J]`` then ``[X,Q,J] @ [X,J,E]`` with X = 1 kv head, Q query
    rows and J key positions, the letters of ``attn/blockwise_tiles.py``), in the same kind of
    loop, as many times as ``count_blocks`` says the kernel visits a block pair,
    for each head: the time XLA's matmuls alone take on this schedule, a floor
    for blockwise's forward pass without the softmax and the masks.
    """
    import jax
    import jax.numpy as jnp

    from attn import masks
    from attn.softmax.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, count_blocks

    B, T, N, H = spec["batch"], spec["T"], spec["heads"], spec["head_dim"]
    bq, bk = min(DEFAULT_BLOCK_Q, T), min(DEFAULT_BLOCK_K, T)
    if T % bq or T % bk or bq * bk > 2**19:
        raise ValueError(f"T: a multiple of {bq} and {bk} with one head per tile, got {T}")
    mask = masks.causal() if causal else masks.full()
    counts = count_blocks(*(jnp.zeros((1, T, 1, H)),) * 3, mask=mask)  # block pairs, one head
    n = (counts.full + counts.partial) * B * N

    def fn(q, k, v):
        q = q[0, :, 0].reshape(-1, 1, bq, H)
        kT = k[0, :, 0].reshape(-1, 1, bk, H).swapaxes(-1, -2)
        v = v[0, :, 0].reshape(-1, 1, bk, H)

        def tile(t, acc):
            s = jnp.einsum("XQH,XHJ->XQJ", q[t % q.shape[0]], kT[t % kT.shape[0]])
            return acc + jnp.einsum("XQJ,XJE->XQE", s, v[t % v.shape[0]])

        return jax.lax.fori_loop(0, n, tile, jnp.zeros((1, bq, H), q.dtype))

    return fn


def _time_torch(spec: dict) -> float:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # torch wants [B,N,T,H]; .contiguous() so the kernel sees its native layout.
    q, k, v, ct = (
        torch.from_numpy(x).to(getattr(torch, spec["dtype"])).transpose(1, 2).contiguous()
        for x in _inputs(spec)
    )
    causal = spec["mask"] == "causal"
    if spec["mode"] == "fwd":

        def run():
            with torch.no_grad():
                sdpa(q, k, v, is_causal=causal)

    else:
        for x in (q, k, v):
            x.requires_grad_(True)

        def run():
            for x in (q, k, v):
                x.grad = None
            (sdpa(q, k, v, is_causal=causal) * ct).sum().backward()

    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    if first > SINGLE_RUN_SECONDS:
        return first
    return _best_of(run, spec["repeats"])
