"""Continuous batching: requests of any length decoded together in a fixed batch of rows.

A serving loop keeps ``batch`` rows busy: a request takes a free row, its
prompt is prefilled while the other rows wait (their length that step is 0,
so their caches do not change), then every busy row decodes one token per
step; a row whose request is done (``max_new_tokens``, or ``eos_id``) is
cleared and the next request takes it, between two steps. Rows are at their
own positions throughout (the cache keeps a length per row).

With ``page_size`` the full layer caches are paged (``attn.paged``): a row
takes a page when it grows past its last one and returns its pages when it
finishes, so the memory in use follows the tokens held, not ``batch x
max_len``. A request is admitted when the pool can hold all the pages it will
need (its prompt plus its new tokens), so a running row never waits for a page.
Window layers keep their ring buffers and recurrent layers their states
(``Decoder.init_cache``); both are cleared with the row.

Everything on the device is two jitted programs (a prefill of ``[batch, T]``,
T the longest prompt's bucket, and a one-token step), compiled once per bucket
(``models.inputs.bucket``: powers of two from 16) of the longest prompt and of
the longest request, not once per run; the bookkeeping (which request holds
which row, the page table) is on the host.
"""

from __future__ import annotations

import collections
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn import checks
from attn.checks import fail
from attn.paged import PageTable, pages_for
from models.cache import clear_rows, set_block_tables
from models.inputs import bucket, check_tokens, pad_prompts, pad_to
from models.sampling import Sampling, sample, sampling, token_logprobs
from models.transformer import Decoder

__all__ = ["serve"]


def serve(
    model,
    prompts,
    max_new_tokens,
    *,
    batch: int,
    max_len: int | None = None,
    page_size: int | None = None,
    num_pages: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    key=None,
    eos_id: int | None = None,
    return_logits: bool = False,
    return_logprobs: bool = False,
):
    """Generates a continuation of each prompt, ``batch`` requests at a time.

    Args:
      model: a ``Decoder``.
      prompts: a list of R 1-D token sequences of any lengths.
      max_new_tokens: tokens to generate per request: an int, or one int per prompt.
      batch: rows decoded at once (requests beyond them wait for a free row).
      max_len: the most tokens a row holds; default the longest request's (prompt
        + new tokens) bucket (``models.inputs.bucket``: the next power of two).
      page_size: tokens per page of a paged cache, or None (contiguous caches).
      num_pages: pages per pool (paged only); default enough for ``batch`` rows
        of ``max_len``. A request needing more pages than the pool has is a
        ``ValueError``.
      temperature, top_k, top_p, min_p, key: as ``models.generate``
        (``models.sampling``); request r's t-th token is drawn with
        ``fold_in(fold_in(key, r), t)``, so a request's tokens do not depend on
        which others ran beside it, and equal ``generate``'s for row r.
      eos_id: a request ends after emitting it (the token is kept).
      return_logits: also return each request's float32 logits ``[n, V]``, the
        distribution each of its n tokens was drawn from.
      return_logprobs: also return each request's ``[n]`` float32
        log-probabilities of its tokens under the model.

    Returns:
      One int32 array of new tokens per prompt (in the prompts' order); with
      ``return_logits`` and/or ``return_logprobs``, a tuple: the tokens, then
      the logits, then the log-probabilities, as asked.
    """
    if not isinstance(model, Decoder):
        fail("model", "a Decoder", type(model).__name__)
    V = model.config.vocab_size
    tokens, lengths = pad_prompts(prompts, "prompts")
    tokens, lengths = check_tokens(tokens, "prompts", vocab=V), np.asarray(lengths)
    R = tokens.shape[0]
    new = _per_request(max_new_tokens, R)
    batch = checks.positive_int(batch, "batch")
    options = sampling(temperature, top_k, top_p, min_p, key, eos_id, V)
    fed = lengths + new - 1  # positions a request writes (its last token is not fed back)
    longest = int((lengths + new).max())
    max_len = bucket(longest) if max_len is None else checks.positive_int(max_len, "max_len")
    if max_len < fed.max():
        fail("max_len", f"at least {int(fed.max())} (the longest prompt + new tokens - 1)", max_len)
    tokens = pad_to(tokens, bucket(tokens.shape[1], max_len))  # the prefill's width: its bucket's
    cache = model.init_cache(batch, max_len, page_size=page_size, num_pages=num_pages)
    table = None
    if page_size is not None:
        M = pages_for(max_len, page_size)
        table = PageTable(num_pages or batch * M, page_size, batch, M)
        need = max(pages_for(n, page_size) for n in fed)
        if need > table.num_pages:
            fail("num_pages", f"at least {need} (the largest request's pages)", table.num_pages)
    graphdef, state = nnx.split(model)
    run = _Run(graphdef, state, cache, table, batch, max_len, page_size, num_pages)
    key = jax.random.PRNGKey(0) if key is None else key
    out_tokens, out_logits, out_logprobs = run.loop(tokens, lengths, new, key, options)
    extras = [x for x, asked in ((out_logits, return_logits), (out_logprobs, return_logprobs))
              if asked]  # fmt: skip
    return (out_tokens, *extras) if extras else out_tokens


def _per_request(max_new_tokens, R: int) -> np.ndarray:
    counts = max_new_tokens
    if isinstance(counts, numbers.Integral) and not isinstance(counts, bool):
        counts = [counts] * R
    counts = list(counts) if isinstance(counts, list | tuple) else None
    if (
        counts is None
        or len(counts) != R
        or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in counts)
    ):
        fail("max_new_tokens", f"a positive int or {R} of them", repr(max_new_tokens))
    return np.asarray(counts, np.int64)


class _Run:
    """One serving run's host state: which request holds each row, the page table, the cache."""

    def __init__(self, graphdef, state, cache, table, batch, max_len, page_size, num_pages):
        self.graphdef, self.state, self.cache, self.table = graphdef, state, cache, table
        self.batch = batch
        self.clear = functools.partial(
            _clear, graphdef, max_len=max_len, page_size=page_size, num_pages=num_pages
        )
        self.request = [None] * batch  # the request each row holds, or None
        self.length = np.zeros(batch, np.int64)  # tokens each row holds
        self.reserved = np.zeros(batch, np.int64)  # pages each row's request will need

    def loop(self, tokens, lengths, new, key, options: Sampling):
        """Serves every request: ``tokens [R,T]`` padded prompts of ``lengths [R]``, ``new [R]``
        tokens each; returns their tokens, logits and log-probabilities (lists of R arrays)."""
        eos_id = int(options.eos_id)
        R, T = tokens.shape
        waiting = collections.deque(range(R))
        out_tokens = [[] for _ in range(R)]
        out_logits = [[] for _ in range(R)]
        out_logprobs = [[] for _ in range(R)]
        last = np.zeros(self.batch, np.int32)  # each row's newest token, fed next step
        while waiting or any(r is not None for r in self.request):
            busy = np.array([r is not None for r in self.request])
            joining = self._admit(waiting, lengths, new)
            if joining.any():  # joining rows prefill their prompts, the others decode
                self.cache = self.clear(self.state, self.cache, jnp.asarray(joining))
                chunk = np.zeros((self.batch, T), np.int32)
                chunk[:, 0] = last
                for b in np.nonzero(joining)[0]:
                    chunk[b] = tokens[self.request[b]]
                count = np.where(joining, lengths[self._request_ids()], busy).astype(np.int32)
            else:
                chunk, count = last[:, None], busy.astype(np.int32)
            logits, logprobs = self._step(chunk, count, key, options, out_tokens, last)
            for b, r in enumerate(self.request):
                if r is None:
                    continue
                out_logits[r].append(logits[b])
                out_logprobs[r].append(logprobs[b])
                if len(out_tokens[r]) == new[r] or out_tokens[r][-1] == eos_id:
                    self._finish(b)
        tokens_out = [np.asarray(t, np.int32) for t in out_tokens]
        logprobs_out = [np.asarray(x, np.float32) for x in out_logprobs]
        return tokens_out, [np.stack(x) for x in out_logits], logprobs_out

    def _request_ids(self) -> np.ndarray:
        """``[batch]`` the request each row holds (0 for a free row)."""
        return np.array([0 if r is None else r for r in self.request])

    def _admit(self, waiting, lengths, new) -> np.ndarray:
        """Gives free rows to waiting requests, in order, while the pool can hold them."""
        joining = np.zeros(self.batch, bool)
        for b in range(self.batch):
            if not waiting or self.request[b] is not None:
                continue
            r = waiting[0]
            pages = 0
            if self.table is not None:
                pages = pages_for(lengths[r] + new[r] - 1, self.table.page_size)
                if self.reserved.sum() + pages > self.table.num_pages:
                    break  # first come, first served: later requests wait too
            waiting.popleft()
            self.request[b], self.reserved[b], joining[b] = r, pages, True
        return joining

    def _finish(self, b: int) -> None:
        self.request[b], self.reserved[b], self.length[b] = None, 0, 0
        if self.table is not None:
            self.table.release(b)

    def _step(self, chunk, count, key, options, out_tokens, last):
        """Runs ``count[b]`` tokens of ``chunk`` per row; samples each busy row's next token.

        Returns ``([batch, V], [batch])``: each row's logits at its last token and
        the log-probability of the token drawn (meaningless for a row that ran none).
        """
        self.length += count
        if self.table is not None:
            for b in np.nonzero(count)[0]:
                self.table.grow(int(b), int(self.length[b]))
            self.cache = set_block_tables(self.cache, self.table.tables)
        keys = np.zeros((self.batch, 2), np.uint32)  # (request, token index) per row
        for b, r in enumerate(self.request):
            if r is not None:
                keys[b] = (r, len(out_tokens[r]))
        logits, nxt, logprobs, self.cache = _prefill_and_sample(
            self.graphdef, self.state, jnp.asarray(chunk), self.cache, jnp.asarray(count),
            key, jnp.asarray(keys), options,
        )  # fmt: skip
        logits, nxt = np.asarray(logits), np.asarray(nxt)
        for b in np.nonzero(count)[0]:
            out_tokens[self.request[b]].append(int(nxt[b]))
            last[b] = nxt[b]
        return logits, np.asarray(logprobs)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill_and_sample(graphdef, state, chunk, cache, count, key, keys, options):
    """Prefills ``count[b]`` tokens per row; each row's logits at its last one, a sample
    and its log-probability. ``keys [B,2]``: (request, token index) per row."""
    logits, cache = nnx.merge(graphdef, state).prefill(chunk, cache, count)
    B = chunk.shape[0]
    last = logits[jnp.arange(B), jnp.maximum(count - 1, 0)]  # [B,V]
    step_keys = jax.vmap(lambda k: jax.random.fold_in(jax.random.fold_in(key, k[0]), k[1]))(keys)
    nxt = sample(last, step_keys, options)
    return last, nxt, token_logprobs(last, nxt), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "page_size", "num_pages"))
def _clear(graphdef, state, cache, rows, *, max_len, page_size, num_pages):
    """``clear_rows`` against a new cache built inside the program (its zeros cost nothing)."""
    model, B = nnx.merge(graphdef, state), cache.lengths.shape[0]
    empty = model.init_cache(B, max_len, page_size=page_size, num_pages=num_pages)
    return clear_rows(cache, empty, rows)
