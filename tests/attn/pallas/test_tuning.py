"""The Pallas kernel's tuning cache: its keys, its lookup, its refusals, and its way to the
kernels (``attn.pallas.tuning``).

No kernel runs here: the settings are read from the ``FlashConfig`` a call
builds, and one ``jax.export`` for ``cuda`` from this CPU shows a named
device's entry reaching each Triton kernel's launch and grid.
"""

import json
import re
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from attn import masks
from attn.pallas import blocks, flash, flash_attention, tuning
from attn.pallas.blocks import BLOCKS, Blocks
from attn.pallas.common import compiler_params
from attn.softmax.call import check_call

GPU = "Test GPU"
WINDOW = masks.causal() & (masks.sliding_window(1024) | masks.initial_tokens(4))
FWD = dict(block_q=64, block_k=32, num_warps=2, num_stages=3)
BWD = dict(block_q=32, block_k=128, num_warps=4, num_stages=1)
ENTRY = {"fwd": FWD, "bwd": BWD}


def tiles(bq, bk, bwd_bq=64, bwd_bk=64, warps=8, stages=2, bwd_warps=4, bwd_stages=3):
    return Blocks(bq, bk, bwd_bq, bwd_bk, warps, stages, bwd_warps, bwd_stages)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache for ``GPU``: causal H=128 bf16 at 4K (ENTRY) and 16K; H=64 causal at 4K."""
    path = tmp_path / "tuned.json"
    entries = {
        "h128-16bit-causal-4096": ENTRY,
        "h128-16bit-causal-16384": tuning.entry_of(tiles(128, 128), {"ms": 1.0}),
        "h64-16bit-causal-4096": tuning.entry_of(tiles(64, 64)),
    }
    tuning.write(path, GPU, entries)
    monkeypatch.setenv(tuning.ENV, str(path))
    return path


def call_of(T, H=128, mask=None, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((1, T, 2, H), dtype)
    return check_call(q, q, q, mask=masks.causal() if mask is None else mask)


def config(T=4096, *, H=128, block_q=None, block_k=None, interpret=False, platform="gpu",
           tiles=None, device_kind=GPU, **kw):  # fmt: skip
    return flash._config(call_of(T, H, **kw), jnp.bfloat16, block_q, block_k, interpret,
                         platform, tiles, device_kind)  # fmt: skip


def test_case_keys():
    assert tuning.case(128, 128, jnp.bfloat16, masks.causal(), 16384, 16384).key == (
        "h128-16bit-causal-16384"
    )
    # float16 shares bfloat16's class; head dims padded to powers of two; lengths rounded up.
    assert tuning.case(80, 64, jnp.float16, masks.full(), 100, 5000).key == "h128-16bit-full-8192"
    assert tuning.case(8, 8, jnp.float32, WINDOW, 16384, 16384).key == "h16-32bit-sparse-16384"
    assert tuning.parse_key("h64-32bit-sparse-1024") == tuning.Case(64, "32bit", "sparse", 1024)
    bad_keys = ["h48-16bit-causal-1024", "h64-8bit-causal-1024", "h64-16bit-band-1024",
                "h64-16bit-causal-1000", "h064-16bit-causal-1024",
                "64-16bit-causal-1024"]  # fmt: skip
    for bad in bad_keys:
        assert tuning.parse_key(bad) is None, bad


def test_mask_classes():
    cls = tuning.mask_class
    for T in (64, 1024, 32768):
        assert cls(masks.causal(), T, T) == "causal" and cls(masks.full(), T, T) == "full"
    # A window is sparse once it is short against the sequence; at 2K it is nearly causal.
    assert cls(WINDOW, 4096, 4096) == cls(WINDOW, 16384, 16384) == "sparse"
    assert cls(WINDOW, 2048, 2048) == "causal"
    assert cls(masks.causal() & masks.chunked(256), 4096, 4096) == "sparse"
    assert cls(masks.bidirectional_window(8192), 4096, 4096) == "full"  # covers everything
    # Default positions: the queries are the last T keys (a decode step sees every key).
    assert cls(masks.causal(), 1, 4096) == "full"
    assert cls(masks.causal(), 2048, 4096) == "causal"


def test_lookup_exact_nearest_and_none(cache):
    def found(T, H=128, mask="causal", dtype="16bit", device=GPU):
        return tuning.lookup(device, tuning.Case(H, dtype, mask, T))

    assert found(4096) == tuning.blocks_of(ENTRY)
    assert found(16384).block_k == 128
    assert found(2048) == found(1024) == found(4096)  # the nearest length in log2
    assert found(8192) == found(32768) == found(16384)  # a tie goes to the longer
    assert found(65536, H=64) == tuning.blocks_of(tuning.entry_of(tiles(64, 64)))
    for missing in (dict(mask="full"), dict(dtype="32bit"), dict(H=256), dict(device="GPU X")):
        assert found(4096, **missing) is None, missing
    assert tuning.lookup(GPU, tuning.Case(128, "16bit", "causal", 4096), path=cache) == found(4096)


def test_the_entry_reaches_the_config_forward_and_backward(cache):
    c = config(T=3000)  # the 4K entry
    assert (c.block_q, c.block_k, c.num_warps, c.num_stages) == (64, 32, 2, 3)
    assert (c.bwd_block_q, c.bwd_block_k, c.bwd_num_warps, c.bwd_num_stages) == (32, 128, 4, 1)
    assert c.launch() == (2, 3) and c.launch(backward=True) == (4, 1)
    fwd, bwd = compiler_params(c), compiler_params(c, backward=True)
    assert (fwd.num_warps, fwd.num_stages, bwd.num_warps, bwd.num_stages) == (2, 3, 4, 1)
    # Explicit block sizes win (both kernels' tiles); the launch stays the entry's.
    c = config(T=3000, block_q=16)
    assert (c.block_q, c.bwd_block_q, c.block_k, c.bwd_block_k, c.num_warps) == (16, 16, 32, 128, 2)
    # Interpret mode takes a named device's tiles, never launch settings.
    c = config(T=3000, interpret=True)
    assert (c.block_q, c.bwd_block_k, c.num_warps, c.bwd_num_warps) == (64, 128, None, None)
    # Tiles longer than the sequence shrink to it, as the defaults do.
    assert config(T=20).block_q == 32


def test_defaults_where_no_entry_or_no_device(cache, monkeypatch):
    default = BLOCKS["gpu"]
    for c in (config(mask=masks.full()), config(device_kind=None), config(H=32)):
        assert (c.block_q, c.block_k, c.bwd_block_q, c.bwd_block_k) == default[:4]
        assert c.num_stages == c.bwd_num_stages == default.num_stages
        assert c.bwd_num_warps == c.num_warps
    # On a GPU host the host's device kind is read; elsewhere none is (a CPU).
    if jax.default_backend() != "gpu":
        assert tuning.host_device_kind() is None
    monkeypatch.setattr(tuning, "host_device_kind", lambda: GPU)
    assert config(device_kind=None).block_k == 32
    assert config(device_kind=None, interpret=True).block_k == BLOCKS["cpu"].block_k
    monkeypatch.setenv(tuning.ENV, "")  # no cache at all
    assert config().block_k == default.block_k


def test_tiles_are_taken_whole_and_checked(cache):
    c = config(tiles=tiles(32, 16, 16, 32, 4, 5, 2, 1))
    assert (c.block_q, c.block_k, c.bwd_block_q, c.bwd_block_k) == (32, 16, 16, 32)
    assert c.launch() == (4, 5) and c.launch(backward=True) == (2, 1)
    c = config(tiles=Blocks(64, 64, 64, 64))  # launch left to the defaults
    assert c.launch() == c.launch(backward=True) == (8, None)
    assert config(tiles=tiles(48, 16), interpret=True).block_q == 48  # any size interpreted
    bad = [
        ((64, 64, 64, 64), r"tiles: expected an attn.pallas.blocks.Blocks or None, got tuple"),
        (tiles(48, 16), r"tiles: expected block_q a power of two >= 16 .*, got 48"),
        (tiles(64, 0), r"tiles: expected block_k a positive int, got 0"),
        (tiles(64, 64, warps=3), r"tiles: expected num_warps a power of two <= 32, got 3"),
        (tiles(64, 64, bwd_stages=True), r"tiles: expected bwd_num_stages a positive int"),
    ]
    q = jnp.zeros((1, 64, 2, 16), jnp.bfloat16)
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            flash_attention(q, q, q, tiles=value, platform="gpu")
    with pytest.raises(ValueError, match=r"device_kind: expected a jax.Device.device_kind"):
        flash_attention(q, q, q, device_kind="", platform="gpu")


def test_export_for_cuda_carries_a_named_devices_entry(cache):
    """From this CPU: each Triton kernel's launch and grid are the entry's (T = 256: four
    query blocks of 64, two dk/dv key blocks of 128), the backward's apart from the forward's."""
    H, T = 128, 256

    def both(q, k, v):
        def loss(q, k, v):
            out = flash_attention(q, k, v, mask=masks.causal(), platform="cuda", device_kind=GPU)
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct((1, T, 2, H), jnp.bfloat16)] * 3
    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    text = jax.export.export(jax.jit(both), platforms=["cuda"], disabled_checks=[check])(*args)
    text = text.mlir_module()
    kernels = {}
    for call in text.split("__gpu$xla.gpu.triton")[1:]:
        attrs = call[: call.index("operand_layouts")]
        found = dict(re.findall(r"\b(grid_z|num_warps|num_stages) = (\d+) : i32", attrs))
        kernels[re.search(r'name = "(\w+)"', attrs).group(1)] = found
    assert kernels == {
        "attn_flash_forward": dict(grid_z="4", num_warps="2", num_stages="3"),
        "attn_flash_dq": dict(grid_z="4", num_warps="4", num_stages="1"),
        "attn_flash_dkdv": dict(grid_z="2", num_warps="4", num_stages="1"),
    }


def test_refusals_name_the_file(tmp_path):
    def one(entry, key="h64-16bit-full-1024"):
        return {"format": 1, "devices": {GPU: {key: entry}}}

    good = one(ENTRY)
    cases = [
        ({"format": 2, "devices": {}}, r"format 2, expected 1"),
        ({"devices": {}}, r'expected a JSON object with "format": 1'),
        ({"format": 1, "devices": {}, "extra": 1}, r'expected the keys "format" and "devices"'),
        ({"format": 1, "devices": []}, r'"devices": expected an object'),
        (one(ENTRY, "h64-16bit-causal-1000"), r"expected a key"),
        (one({"fwd": FWD}), r'expected an object with "fwd" and "bwd"'),
        (one(dict(ENTRY, x=1)), r"unknown keys \['x'\]"),
        (one(dict(ENTRY, bwd=FWD | {"block_k": 48})),
         r"bwd.block_k: expected a power of two >= 16 .*, got 48"),
        (one(dict(ENTRY, fwd=dict(FWD, num_warps=6))),
         r"fwd.num_warps: expected a power of two <= 32, got 6"),
        (one(dict(ENTRY, fwd={"block_q": 64})), r"fwd: expected the keys"),
    ]  # fmt: skip
    for n, (data, message) in enumerate(cases):
        path = tmp_path / f"bad{n}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=re.escape(str(path)) + ": .*" + message) as e:
            tuning.load(path)
        assert "\n" not in str(e.value)
    # One case twice for a device: JSON would keep the second and drop the first.
    path = tmp_path / "twice.json"
    entry = json.dumps(ENTRY)
    path.write_text(f'{{"format": 1, "devices": {{"{GPU}": {{"h64-16bit-full-1024": {entry}, '
                    f'"h64-16bit-full-1024": {entry}}}}}}}')  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": expected each key once in an "
                       r"object, got \['h64-16bit-full-1024'\] twice$"):  # fmt: skip
        tuning.load(path)
    path = tmp_path / "not.json"
    path.write_text("{format: 1")
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": not JSON"):
        tuning.load(path)
    with pytest.raises(ValueError, match=r"missing.json: cannot read the tuning cache"):
        tuning.load(tmp_path / "missing.json")
    path.write_text(json.dumps(good))
    assert tuning.load(path) == {
        GPU: {tuning.parse_key("h64-16bit-full-1024"): tuning.blocks_of(ENTRY)}
    }
    with pytest.raises(ValueError, match=r"blocks: expected settings a cache entry can hold"):
        tuning.entry_of(Blocks(64, 64, 64, 64))  # launch settings left open


def test_write_merges_devices_and_cases(tmp_path):
    path = tmp_path / "tuned.json"
    tuning.write(path, GPU, {"h64-16bit-full-1024": ENTRY})
    tuning.write(path, "Other GPU", {"h64-16bit-full-1024": tuning.entry_of(tiles(16, 16))})
    tuning.write(path, GPU, {"h128-16bit-causal-4096": tuning.entry_of(tiles(32, 32), {"ms": 2})})
    data = tuning.read(path)
    assert sorted(data["devices"]) == ["Other GPU", GPU]
    assert sorted(data["devices"][GPU]) == ["h128-16bit-causal-4096", "h64-16bit-full-1024"]
    assert data["devices"][GPU]["h128-16bit-causal-4096"]["measured"] == {"ms": 2}
    assert data["format"] == tuning.FORMAT
    # Written from another base: the base's entries and the new ones; the base is untouched.
    out = tuning.write(tmp_path / "out" / "copy.json", "cpu", {"h16-16bit-full-64": ENTRY}, path)
    assert sorted(tuning.read(out)["devices"]) == ["Other GPU", GPU, "cpu"]
    assert "cpu" not in tuning.read(path)["devices"]


def test_the_committed_cache_is_readable_and_ships():
    """Checked as the kernels read it, and listed as package data beside the module."""
    assert tuning.CACHE.parent == Path(blocks.__file__).parent
    root = Path(__file__).resolve().parents[3]
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tuning.CACHE.name in setup["package-data"]["attn.pallas"]
    assert tuning.read(tuning.CACHE)["format"] == tuning.FORMAT
    for kind, entries in tuning.load(tuning.CACHE).items():
        assert kind and entries
