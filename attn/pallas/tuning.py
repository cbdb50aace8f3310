"""Measured tiles and launch settings of ``attn.pallas.flash_attention``, per GPU, from a cache.

``attn/pallas/tuned.json`` ships with the package. ``bench/device.py``'s ``tune``
phase (``bench/_device_tune.py``) writes it on a lent GPU; ``flash_attention``
(and ``attn.attention(impl="pallas")``) reads it when it compiles for a GPU
whose ``jax.Device.device_kind`` has entries (the host's default device, when
``jax.default_backend()`` is ``"gpu"``). Interpret mode and lowering for a GPU
from another host (``platform="gpu"`` on a CPU, as ``jax.export`` does) use the
defaults of ``attn.pallas.blocks.BLOCKS`` unless the caller names a device
(``flash_attention(device_kind=...)``). Explicit ``block_q``/``block_k`` win
over an entry, and an explicit ``tiles=`` replaces it. The entry is read when
the call is traced: a program already compiled keeps the settings it had.

Format 1 (JSON)::

    {"format": 1,
     "devices": {
       "NVIDIA H200": {                          # jax.Device.device_kind
         "h128-16bit-causal-16384": {            # a case key (below)
           "fwd": {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
           "bwd": {"block_q": 64, "block_k": 128, "num_warps": 8, "num_stages": 2},
           "measured": {...}                     # optional, free-form: what the sweep saw
         }}}}

* ``fwd``: the forward kernel's tiles (``block_q`` query rows per program,
  ``block_k`` keys per inner step), which the dq kernel shares (it walks the
  forward's schedule), and the forward kernel's Triton ``num_warps`` and
  ``num_stages``;
* ``bwd``: the dk/dv kernel's tiles (``block_q`` query rows per inner step,
  ``block_k`` keys per program) and the Triton launch of both backward kernels
  (dq and dk/dv).

Tiles are powers of two >= 16, ``num_warps`` a power of two <= 32, ``num_stages``
an int >= 1; ``measured`` is never read. A case key is
``h<head>-<dtype>-<mask>-<length>``:

* ``head``: ``max(H, E)`` padded to a power of two >= 16, as the compiled
  kernels hold it (``attn.pallas.blocks.padded_head_dim``);
* ``dtype``: the operands' common dtype by width: ``16bit`` (bfloat16 and
  float16 share it: the same tiles fit the same shared memory and tensor-core
  shapes) or ``32bit`` (float32);
* ``mask``: ``mask_class``: ``full`` (every tile unmasked), ``causal`` (dense
  with masked tiles: about half the tiles or more are visited) or ``sparse``
  (a window, chunks, ...: under 40% of the tiles visited), read from the mask
  on the default positions;
* ``length``: ``max(T, S)`` rounded up to a power of two.

Lookup takes the entry of the same key, else the nearest measured length of
the same head, dtype and mask (by ``log2``; a tie goes to the longer), else
none (the defaults). A file of another format, a malformed file or entry, or
an unreadable one raises a ``ValueError`` naming the file: it is never used in
part. ``ATTN_PALLAS_TUNED`` names another cache file (an empty value: none at
all, the defaults everywhere).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from attn import masks
from attn.checks import fail
from attn.pallas.blocks import MIN_BLOCK, Blocks, next_power_of_2, padded_head_dim

FORMAT = 1
CACHE = Path(__file__).with_name("tuned.json")
ENV = "ATTN_PALLAS_TUNED"
DTYPES = ("16bit", "32bit")
MASKS = ("full", "causal", "sparse")
# mask_class: the mask is read on a GRID x GRID table of blocks; a table with
# under SPARSE_BELOW of its blocks visited is sparse (causal visits ~53% of 16 x 16).
GRID = 16
SPARSE_BELOW = 0.4
MAX_WARPS = 32
TILE_FIELDS = ("block_q", "block_k", "num_warps", "num_stages")
_KEY = re.compile(r"h(\d+)-(\w+)-(\w+)-(\d+)")


class Case(NamedTuple):
    """What an entry is measured for (see the module docstring)."""

    head: int  # max(H, E) padded to a power of two >= 16
    dtype: str  # "16bit" or "32bit"
    mask: str  # "full", "causal" or "sparse"
    length: int  # max(T, S) rounded up to a power of two

    @property
    def key(self) -> str:
        return f"h{self.head}-{self.dtype}-{self.mask}-{self.length}"


def parse_key(key: str) -> Case | None:
    """The case of a key, or None where it is not one."""
    match = _KEY.fullmatch(key) if isinstance(key, str) else None
    if match is None:
        return None
    head, dtype, mask, length = match.groups()
    case = Case(int(head), dtype, mask, int(length))
    if (
        dtype not in DTYPES
        or mask not in MASKS
        or not _power_of_two(case.head, MIN_BLOCK)
        or not _power_of_two(case.length, 1)
        or case.key != key  # no leading zeros
    ):
        return None
    return case


def case(H: int, E: int, dtype, mask: masks.Mask, T: int, S: int) -> Case:
    """The case of a call: head dims, the operands' common dtype, the mask, the lengths."""
    return Case(
        head=max(padded_head_dim(H), padded_head_dim(E)),
        dtype=dtype_class(dtype),
        mask=mask_class(mask, T, S),
        length=next_power_of_2(max(T, S)),
    )


def dtype_class(dtype) -> str:
    """``"16bit"`` for bfloat16 and float16, ``"32bit"`` for float32 (by the item width)."""
    return f"{np.dtype(dtype).itemsize * 8}bit"


@functools.lru_cache(maxsize=512)
def mask_class(mask: masks.Mask, T: int, S: int) -> str:
    """``"full"``, ``"causal"`` or ``"sparse"``: the mask's block table on the default
    positions (the queries the last T of S keys), at ``GRID x GRID`` blocks.

    Every block FULL is ``full``; under ``SPARSE_BELOW`` of the blocks visited is
    ``sparse``; the rest is ``causal``. Segment ids, explicit positions and the
    bias and mask arrays are not read (they are traced arrays in a model): the
    kernels still skip what their own schedule finds empty.
    """
    kinds = masks.block_schedule(mask, T, S, -(-T // GRID), -(-S // GRID), q_offset=S - T)
    if (kinds == masks.BlockKind.FULL).all():
        return "full"
    visited = (kinds != masks.BlockKind.EMPTY).mean()
    return "sparse" if visited < SPARSE_BELOW else "causal"


def host_device_kind() -> str | None:
    """The host's default device's kind when it is a GPU (``"NVIDIA H200"``), else None."""
    if jax.default_backend() != "gpu":
        return None
    return jax.devices()[0].device_kind


def cache_path() -> Path | None:
    """The cache file in use: ``$ATTN_PALLAS_TUNED`` if set (None if empty), else
    ``CACHE`` where it exists."""
    given = os.environ.get(ENV)
    if given is not None:
        return Path(given) if given else None
    return CACHE if CACHE.is_file() else None


def lookup(device_kind: str, want: Case, path: Path | str | None = None) -> Blocks | None:
    """The settings measured for ``want`` on ``device_kind``: its entry, else the nearest
    length of its head, dtype and mask; None without one. ``path``: ``cache_path()``."""
    path = cache_path() if path is None else Path(path)
    if path is None:
        return None
    entries = load(path).get(device_kind, {})
    same = {c.length: blocks for c, blocks in entries.items() if c[:3] == want[:3]}
    if not same:
        return None
    target = math.log2(want.length)
    nearest = min(same, key=lambda length: (abs(math.log2(length) - target), -length))
    return same[nearest]


def load(path: Path | str) -> dict[str, dict[Case, Blocks]]:
    """The cache file at ``path``, checked: device kind -> case -> settings."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the tuning cache ({e.strerror})") from None
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


def read(path: Path | str) -> dict:
    """The cache file's JSON as written, after the checks of ``load``."""
    load(path)
    return json.loads(Path(path).read_text())


@functools.lru_cache(maxsize=8)
def _parsed(path: str, mtime_ns: int, size: int) -> dict[str, dict[Case, Blocks]]:
    """``load``'s work, cached by the file's path, modification time and size."""
    del mtime_ns, size  # the cache key: a rewritten file is read again
    try:
        data = json.loads(Path(path).read_text(), object_pairs_hook=_unique_keys)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the tuning cache ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    except _DuplicateKeys as e:
        raise ValueError(f"{path}: {e}") from None
    problem = _format_problem(data)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    out = {}
    for kind, entries in data["devices"].items():
        out[kind] = {}
        for key, entry in entries.items():
            where = f"device {kind!r}, case {key!r}"
            found = parse_key(key)
            if found is None:
                raise ValueError(
                    f"{path}: {where}: expected a key h<head>-<{'|'.join(DTYPES)}>-"
                    f"<{'|'.join(MASKS)}>-<length> (head and length powers of two)"
                )
            problem = _entry_problem(entry)
            if problem is not None:
                raise ValueError(f"{path}: {where}: {problem}")
            out[kind][found] = blocks_of(entry)
    return out


class _DuplicateKeys(ValueError):
    pass


def _unique_keys(pairs: list[tuple]) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice (JSON keeps the last: a
    case measured twice for a device would silently lose one)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise _DuplicateKeys(f"expected each key once in an object, got {twice} twice")
    return dict(pairs)


def _format_problem(data) -> str | None:
    if not isinstance(data, dict) or "format" not in data:
        return f'expected a JSON object with "format": {FORMAT}'
    if data["format"] != FORMAT or isinstance(data["format"], bool):
        return f"format {data['format']!r}, expected {FORMAT} (this attnlab reads format {FORMAT})"
    if set(data) != {"format", "devices"}:
        return f'expected the keys "format" and "devices", got {sorted(data)}'
    devices = data["devices"]
    if not isinstance(devices, dict):
        return f'"devices": expected an object, got {type(devices).__name__}'
    for kind, entries in devices.items():
        if not kind or not isinstance(entries, dict):
            return f"device {kind!r}: expected a non-empty device kind and an object of cases"
    return None


def _entry_problem(entry) -> str | None:
    if not isinstance(entry, dict) or not {"fwd", "bwd"} <= set(entry):
        return 'expected an object with "fwd" and "bwd"'
    extra = set(entry) - {"fwd", "bwd", "measured"}
    if extra:
        return f"unknown keys {sorted(extra)}"
    for part in ("fwd", "bwd"):
        settings = entry[part]
        if not isinstance(settings, dict) or set(settings) != set(TILE_FIELDS):
            got = sorted(settings) if isinstance(settings, dict) else type(settings).__name__
            return f"{part}: expected the keys {list(TILE_FIELDS)}, got {got}"
        for field in TILE_FIELDS:
            problem = _setting_problem(field, settings[field], compiled=True)
            if problem is not None:
                return f"{part}.{field}: expected {problem}, got {settings[field]!r}"
    return None


def _setting_problem(field: str, value, compiled: bool) -> str | None:
    """What ``value`` should be as ``field`` (a tile or a launch setting), or None if it is."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        return "a positive int"
    if field.endswith("num_warps") and not _power_of_two(value, 1, MAX_WARPS):
        return f"a power of two <= {MAX_WARPS}"
    if "block" in field and compiled and not _power_of_two(value, MIN_BLOCK):
        return f"a power of two >= {MIN_BLOCK} for a compiled kernel"
    return None


def _power_of_two(n, minimum: int, maximum: int | None = None) -> bool:
    return n >= minimum and not n & (n - 1) and (maximum is None or n <= maximum)


def check_tiles(tiles, compiled: bool) -> Blocks:
    """``flash_attention``'s ``tiles``: an ``attn.pallas.blocks.Blocks`` of positive ints
    (powers of two >= 16 for a compiled kernel), launch settings None or positive
    (``num_warps`` a power of two); else the uniform ``ValueError``."""
    if not isinstance(tiles, Blocks):
        fail("tiles", "an attn.pallas.blocks.Blocks or None", type(tiles).__name__)
    for field, value in tiles._asdict().items():
        if value is None and "num_" in field:
            continue
        problem = _setting_problem(field, value, compiled)
        if problem is not None:
            fail("tiles", f"{field} {problem}", repr(value))
    return tiles


def blocks_of(entry: dict) -> Blocks:
    """A checked entry's settings as ``Blocks``."""
    fwd, bwd = entry["fwd"], entry["bwd"]
    return Blocks(
        block_q=fwd["block_q"],
        block_k=fwd["block_k"],
        bwd_block_q=bwd["block_q"],
        bwd_block_k=bwd["block_k"],
        num_warps=fwd["num_warps"],
        num_stages=fwd["num_stages"],
        bwd_num_warps=bwd["num_warps"],
        bwd_num_stages=bwd["num_stages"],
    )


def entry_of(blocks: Blocks, measured: dict | None = None) -> dict:
    """``blocks`` (every field given) as a cache entry, with what was measured."""
    b = blocks
    entry = {
        "fwd": dict(block_q=b.block_q, block_k=b.block_k, num_warps=b.num_warps,
                    num_stages=b.num_stages),
        "bwd": dict(block_q=b.bwd_block_q, block_k=b.bwd_block_k, num_warps=b.bwd_num_warps,
                    num_stages=b.bwd_num_stages),
    }  # fmt: skip
    if measured is not None:
        entry["measured"] = measured
    problem = _entry_problem(entry)
    if problem is not None:
        fail("blocks", f"settings a cache entry can hold ({problem})", repr(blocks))
    return entry


def write(path: Path | str, device_kind: str, entries: dict[str, dict],
          base: Path | str | None = None) -> Path:  # fmt: skip
    """Writes ``base``'s cache (``path``'s when None, nothing where it does not exist)
    with ``entries`` (case key -> ``entry_of``) set for ``device_kind`` to ``path``,
    keeping every other entry; checks what it wrote."""
    path = Path(path)
    base = path if base is None else Path(base)
    data = read(base) if base.is_file() else {"format": FORMAT, "devices": {}}
    data["devices"].setdefault(device_kind, {}).update(entries)
    data["devices"] = {
        kind: dict(sorted(cases.items())) for kind, cases in sorted(data["devices"].items())
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_dumps(data) + "\n")
    load(path)
    return path


def _dumps(x, depth: int = 0) -> str:
    """JSON indented down to the entries' parts; each part (``fwd``, ``bwd``,
    ``measured``) on one line."""
    if not isinstance(x, dict) or depth == 4 or not x:
        return json.dumps(x)
    pad = "  " * (depth + 1)
    items = [f"{pad}{json.dumps(k)}: {_dumps(v, depth + 1)}" for k, v in x.items()]
    return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
