"""The experiments on trained heads; each writes ``results/<name>/`` and supports a claim.

- ``induction_heads``: induction heads form with a jump in in-context learning (Olsson et al.).
- ``sinks_streaming``: first-token (sink) mass, and streaming past the training length
  with full attention, a plain window, and a window plus 4 initial tokens (StreamingLLM).
- ``head_pruning``: head importance and the pruning curve, by importance vs random
  (Michel et al.).
- ``windows_global``: window layers with a global layer in every three keep
  long-range recall that window-only layers lose (MQAR accuracy per gap).
- ``recall_frontier``: MQAR accuracy against decode-state size for every family
  (Zoology's recall-memory trade-off), with its own flags (``--scale``, ``--only``,
  ``--jobs``, ``--dry-run``).
- ``state_tracking``: parity, addition mod m, S3 and S5 at 1x, 2x and 4x the training
  length, for MHA, linear attention, Mamba-2 and the delta rule with and without
  negative eigenvalues, DeltaProduct and a hybrid (two rows: claims 16 and 17).
- ``sparse``: needles and MQAR at 256 to 4096 tokens for MoBA, NSA and DSA against MHA, a
  window reading as many keys and Gated DeltaNet, with the keys each query reads (claim 18).
- ``sinks_gated``: where ungated MHA shows a sink on English, and whether gated attention
  (Qiu et al. 2025) at the same size and budget removes it (claim 19).

Run one with ``python -m analysis.experiments.<name> [--quick] [--out DIR]``. Each
module has ``NAME``, ``run(config, out_dir) -> dict`` and ``main(argv) -> int``;
its config is ``configs/<name>.py`` (``get_config(quick=False)``).
"""

NAMES = (
    "induction_heads",
    "sinks_streaming",
    "head_pruning",
    "windows_global",
    "recall_frontier",
    "state_tracking",
    "sparse",
    "sinks_gated",
)
