"""The families phase's inputs (``bench/_device_families.py``): device arrays, our forms and
the peers of each item."""

from __future__ import annotations

from bench._device_common import interpreted
from bench._device_families_plan import (
    BLOCKWISE_MAX_T,
    CG_STEPS,
    MEMORIES,
    MINI_BATCH,
    NEWER,
    PEERLESS,
)


class Inputs:
    """Random device arrays, drawn by ``jax.random`` (fast on the device, unlike NumPy's at
    these sizes) from one key; cast to the dtype asked for after drawing in float32."""

    def __init__(self, seed: int = 0):
        import jax

        self.key = jax.random.key(seed)

    def _next(self):
        import jax

        self.key, sub = jax.random.split(self.key)
        return sub

    def normal(self, *shape, dtype="bfloat16", scale=1.0, unit=False):
        import jax
        import jax.numpy as jnp

        x = jax.random.normal(self._next(), shape, jnp.float32) * scale
        if unit:
            x = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        return x.astype(dtype)

    def uniform(self, *shape, low=0.0, high=1.0, dtype="float32"):
        import jax
        import jax.numpy as jnp

        x = jax.random.uniform(self._next(), shape, jnp.float32, low, high)
        return x.astype(dtype)


def setup(item: dict) -> dict:
    """The inputs (device arrays), our forms and the peers of ``item``.

    Returns ``{"args": {name: array}`` in call order, ``"grads"``: how many of the
    first args get gradients, ``"out"``: the output's shape, ``"forms"``: ``{form:
    fn(*args)}`` (or a ``"not measured: ..."`` string), ``"peers"``: ``{label: kind}``}.
    """
    import jax
    import jax.numpy as jnp

    import attn
    from attn import masks

    family = item["family"]
    r = Inputs(0)
    if family == "decode":
        return _decode_setup(item, r)
    if family in NEWER:
        return _newer_setup(item, r)
    if family in MEMORIES:
        return _memory_setup(item, r)
    B, T, N, H = item["B"], item["T"], item["N"], item["H"]
    chunk = item.get("chunk")
    causal = masks.causal()
    if family in ("softmax", "sparse"):
        K = item.get("K", N)
        args = {"q": r.normal(B, T, N, H), "k": r.normal(B, T, K, H), "v": r.normal(B, T, K, H)}
        if family == "sparse":
            return _sparse_setup(item, args, r)

        def form(impl):
            return lambda q, k, v: attn.attention(q, k, v, mask=causal, impl=impl,
                                                  **interpreted(impl))  # fmt: skip

        forms = {impl: form(impl) for impl in ("pallas", "mosaic", "blockwise")}
        if H not in (64, 128):  # a dry run's head dim
            forms["mosaic"] = f"not measured: head dim {H} (Mosaic GPU takes 64 and 128)"
        if T > BLOCKWISE_MAX_T:
            forms["blockwise"] = f"not measured: T > {BLOCKWISE_MAX_T} (seconds a step)"
        return dict(args=args, grads=3, out=(B, T, N, H), forms=forms, peers={"cudnn": "cudnn"})
    E = item["E"]
    if family == "ssd":
        args = {
            "x": r.normal(B, T, N, E),
            "dt": jax.nn.softplus(r.normal(B, T, N, dtype="float32") - 3),
            "A": -r.uniform(N, low=1.0, high=16.0),
            "B": r.normal(B, T, 1, H, scale=H**-0.5),
            "C": r.normal(B, T, 1, H, scale=H**-0.5),
            "D": jnp.ones((N,), jnp.float32),
        }

        def ssd(x, dt, A, b, c, D):
            return attn.ssd(x, dt, A, b, c, D=D, chunk_size=chunk)

        return dict(
            args=args, grads=6, out=(B, T, N, E), forms={"chunkwise": ssd}, peers={"fla": "fla"}
        )
    steps = (item["n"],) if family == "deltaproduct" else ()
    args = {
        "q": r.normal(B, T, N, H, unit=True),
        "k": r.normal(B, T, *steps, N, H, unit=True),
        "v": r.normal(B, T, *steps, N, E),
        "beta": r.uniform(B, T, *steps, N, dtype="bfloat16"),
    }
    if family in ("gated_deltanet", "deltaproduct"):
        args["g"] = -r.uniform(B, T, N, low=0.001, high=0.1)
    if family == "kda":
        args["g"] = -r.uniform(B, T, N, H, low=0.001, high=0.1)
    if family == "linear":
        del args["beta"]

        def form(q, k, v):
            return attn.linear_attention(
                q,
                k,
                v,
                form="chunkwise",
                feature_map="identity",
                normalize=False,
                scale=H**-0.5,
                chunk_size=chunk,
            )

    elif family == "deltaproduct":

        def form(q, k, v, beta, g):
            return attn.delta_product(q, k, v, beta, log_gates=g, chunk_size=chunk)

    else:

        def form(q, k, v, beta, g=None):
            return attn.delta_rule(q, k, v, beta, log_gates=g, chunk_size=chunk)

    return dict(
        args=args,
        grads=len(args),
        out=(B, T, N, E),
        forms={"chunkwise": form},
        peers={"fla": "fla"},
    )


def _newer_setup(item: dict, r: Inputs) -> dict:
    """The DPLR delta rule (RWKV-7), PaTH (with FoX's gate) and log-linear Mamba-2, each in
    the meaning of the fla op it is timed against (``bench/_fla_peer.py``)."""
    import jax
    import jax.numpy as jnp

    import attn

    family, B, T, N, H = item["family"], item["B"], item["T"], item["N"], item["H"]
    chunk = item["chunk"]
    if family == "dplr":  # RWKV-7: a = -kappa, b = kappa * a_in, log_w in (-0.6, 0), scale 1
        E = item["E"]
        kappa = r.normal(B, T, N, H, dtype="float32", unit=True)
        args = {
            "q": r.normal(B, T, N, H, scale=H**-0.5),
            "k": r.normal(B, T, N, H, scale=H**-0.5),
            "v": r.normal(B, T, N, E),
            "a": (-kappa).astype(jnp.bfloat16),
            "b": (kappa * r.uniform(B, T, N, H)).astype(jnp.bfloat16),
            "log_w": -r.uniform(B, T, N, H, low=0.001, high=0.6),
        }

        def form(q, k, v, a, b, log_w):
            return attn.dplr_delta_rule(q, k, v, a, b, log_w, scale=1.0, chunk_size=chunk)

        out = (B, T, N, E)
    elif family == "path":  # w, beta and the gate float32, as fla asks
        args = {
            "q": r.normal(B, T, N, H),
            "k": r.normal(B, T, N, H),
            "v": r.normal(B, T, N, H),
            "w": r.normal(B, T, N, H, dtype="float32", unit=True),
            "beta": r.uniform(B, T, N, low=0.0, high=2.0),
            "g": -r.uniform(B, T, N, low=0.001, high=0.1),
        }
        scale = H**-0.5

        def form(q, k, v, w, beta, g):  # fla scales its gate's sums with the logits
            return attn.path_attention(
                q, k, v, w, beta, log_forget=g * scale, scale=scale, block_size=chunk
            )

        out = (B, T, N, H)
    else:  # log-linear Mamba-2: q = C, k = B (one group), v = dt x, g = dt A, every level
        E, L = item["E"], (T - 1).bit_length() + 1
        dt = jax.nn.softplus(r.normal(B, T, N, dtype="float32") - 3)
        args = {
            "q": r.normal(B, T, 1, H, scale=H**-0.5),
            "k": r.normal(B, T, 1, H, scale=H**-0.5),
            "v": r.normal(B, T, N, E),
            "g": dt * -r.uniform(N, low=1.0, high=16.0),
            "level_scales": r.uniform(B, T, N, L, low=0.5, high=1.5),
        }

        def form(q, k, v, g, level_scales):
            return attn.log_linear_attention(q, k, v, g, level_scales, scale=1.0, chunk_size=chunk)

        out = (B, T, N, E)
    name = "blockwise" if family == "path" else "chunkwise"
    return dict(args=args, grads=len(args), out=out, forms={name: form}, peers={"fla": "fla"})


def _memory_setup(item: dict, r: Inputs) -> dict:
    """TTT-Linear, TTT-MLP and Titans (mini-batches of 16, the LayerNorm in the inner
    model) and MesaNet (fla's ``chunk_mesa_net``'s meaning: scale 1, k unit-norm, 30 CG
    steps); q, k and v bf16, the gates, rates and the norm's parameters float32."""
    import jax.numpy as jnp

    import attn

    family, B, T, N, H = item["family"], item["B"], item["T"], item["N"], item["H"]
    qkv = {"q": r.normal(B, T, N, H, unit=True), "k": r.normal(B, T, N, H, unit=True),
           "v": r.normal(B, T, N, H)}  # fmt: skip
    if family == "mesa_net":
        args = {
            **qkv,
            "beta": r.uniform(B, T, N, dtype="bfloat16"),
            "g": -r.uniform(B, T, N, low=0.001, high=0.1),
            "lamb": jnp.log1p(jnp.exp(r.uniform(N, H))) + 0.25,  # the layer's softplus + 1/4
        }

        def form(q, k, v, beta, g, lamb):
            return attn.mesa_net(q, k, v, beta, lamb, log_gates=g, cg_steps=CG_STEPS,
                                 chunk_size=item["chunk"])  # fmt: skip

        return dict(args=args, grads=len(args), out=(B, T, N, H), forms={"chunkwise": form},
                    peers={"fla": "fla"})  # fmt: skip
    norm = {"w": 1 + r.normal(N, H, dtype="float32", scale=0.1),
            "b": r.normal(N, H, dtype="float32", scale=0.1)}  # fmt: skip
    if family == "titans":
        gates = {
            "theta": r.uniform(B, T, N, high=0.1 / H),
            "log_momentum": jnp.log(r.uniform(B, T, N, low=0.8, high=0.95)),
            "log_decay": jnp.log1p(-r.uniform(B, T, N, low=0.001, high=0.02)),
        }

        def form(q, k, v, theta, log_momentum, log_decay, w, b):
            return attn.titans(q, k, v, theta, log_momentum, log_decay, norm_scale=w,
                               norm_bias=b, memory="mlp", mini_batch=MINI_BATCH)  # fmt: skip

        peers = {}
    else:  # TTT: eta = base_lr sigmoid(.) / H, in (0, 1 / H)
        gates = {"eta": r.uniform(B, T, N, high=1.0 / H)}
        fn = attn.ttt_mlp if family == "ttt_mlp" else attn.ttt_linear

        def form(q, k, v, eta, w, b):
            return fn(q, k, v, eta, norm_scale=w, norm_bias=b, mini_batch=MINI_BATCH)

        peers = {} if family in PEERLESS else {"fla": "fla"}
    args = {**qkv, **gates, **norm}
    return dict(args=args, grads=len(args), out=(B, T, N, H), forms={"dual": form},
                peers=peers)  # fmt: skip


def _sparse_setup(item: dict, args: dict, r: Inputs) -> dict:
    import jax

    import attn
    from attn import masks

    B, T, N = item["B"], item["T"], item["N"]
    causal = masks.causal()
    win = dict(compress_block=item["compress_block"], compress_stride=item["compress_stride"])
    args.update(
        gates=jax.nn.sigmoid(r.normal(B, T, N, 3, dtype="float32")).astype("bfloat16"),
        ck=attn.sparse.compression_windows(args["k"], **win)[0].mean(2),
        cv=attn.sparse.compression_windows(args["v"], **win)[0].mean(2),
        iq=r.normal(B, T, item["index_heads"], item["index_dim"], dtype="float32"),
        ik=r.normal(B, T, item["index_dim"], dtype="float32"),
        iw=abs(r.normal(B, T, item["index_heads"], dtype="float32")),
    )
    nsa_sizes = dict(
        select_block=item["select_block"],
        num_selected=item["num_selected"],
        window=item["window"],
        initial_blocks=1,
        local_blocks=2,
        **win,
    )

    def moba(q, k, v, *_):
        return attn.moba_attention(
            q,
            k,
            v,
            block_size=item["moba_block"],
            top_k=item["moba_top_k"],
            mask=causal,
            impl="pallas",
            **interpreted(),
        )

    def nsa(q, k, v, gates, ck, cv, *_):
        return attn.nsa_attention(q, k, v, gates, ck, cv, mask=causal, impl="pallas",
                                  **nsa_sizes, **interpreted())  # fmt: skip

    def dsa(q, k, v, gates, ck, cv, iq, ik, iw):
        return attn.indexed_topk_attention(
            q, k, v, iq, ik, iw, top_k=item["dsa_top_k"], mask=causal
        )

    return dict(
        args=args,
        grads=3,
        out=(B, T, N, item["H"]),
        forms={"moba": moba, "nsa": nsa, "dsa": dsa},
        peers={"cudnn dense": "cudnn", "fla nsa": "fla"},
    )


def _decode_setup(item: dict, r: Inputs) -> dict:
    import jax.numpy as jnp
    import numpy as np

    import attn

    B, S, N, K, H, page = (item[x] for x in ("B", "S", "N", "K", "H", "page"))
    k, v = r.normal(B, S, K, H), r.normal(B, S, K, H)
    # The same cache in a pool of shuffled pages: row b's page i is pool page tables[b, i].
    per_row = -(-S // page)
    order = np.random.default_rng(0).permutation(B * per_row).astype(np.int32)
    back = jnp.asarray(np.argsort(order))  # pool page p holds the cache's page back[p]

    def pool(x):
        x = jnp.pad(x, [(0, 0), (0, per_row * page - S), (0, 0), (0, 0)])
        return jnp.take(x.reshape(B * per_row, page, K, H), back, axis=0)

    args = {
        "q": r.normal(B, 1, N, H),
        "k": k,
        "v": v,
        "lengths": jnp.full((B,), S, jnp.int32),
        "pool_k": pool(k),
        "pool_v": pool(v),
        "tables": jnp.asarray(order.reshape(B, per_row)),
    }

    def split(q, k, v, lengths, *_):
        return attn.decode_attention(q, k, v, lengths=lengths)

    def split_pallas(q, k, v, lengths, *_):
        return attn.decode_attention(q, k, v, lengths=lengths, impl="pallas", **interpreted())

    def paged(q, k, v, lengths, pool_k, pool_v, tables):
        return attn.paged_decode_attention(q, pool_k, pool_v, tables, lengths)

    return dict(
        args=args,
        grads=0,
        out=(B, 1, N, H),
        forms={"split-K": split, "split-K pallas": split_pallas, "paged": paged},
        peers={"jax.nn": "jax.nn"},
    )


def host(args: dict) -> tuple[dict, dict]:
    """``(arrays, dtypes)``: host copies of the device ``args`` for the torch side, bf16 as
    its bits (``uint16``: NumPy has no bf16 torch reads), and each one's dtype name."""
    import numpy as np

    arrays, dtypes = {}, {}
    for name, x in args.items():
        dtypes[name] = str(x.dtype)
        a = np.array(x)  # a writable copy (torch warns on a read-only one)
        arrays[name] = a.view(np.uint16) if dtypes[name] == "bfloat16" else a
    return arrays, dtypes
