"""Block sizes of the Pallas kernels, per platform, in one table.

``BLOCKS[platform]`` holds the forward and backward tile sizes of
``attn.pallas.flash_attention`` (``block_q`` query rows by ``block_k`` keys)
and, on GPUs, the Triton launch settings; ``SPLASH_BLOCK[platform]`` the tile of
``attn.pallas.splash_attention``. None of the accelerator entries has been
measured in this repository yet (no GPU or TPU was available where they were
written): the GPU ones are the usual FlashAttention-2 choices for H <= 128 on
Hopper-class GPUs, the TPU ones multiples of the 128-lane vector unit. Change
them here, after a run of ``bench/gpu.py``, and nowhere else.

These are the defaults. On a GPU whose device kind has measured entries,
``attn.pallas.tuning`` (its docstring holds the cache's format) overrides them
per case with the committed ``attn/pallas/tuned.json``.
"""

from __future__ import annotations

from typing import NamedTuple


class Blocks(NamedTuple):
    """Tile sizes (powers of two: Triton needs them) and launch settings of one platform
    or one tuned case; ``flash_attention(tiles=...)`` takes one."""

    block_q: int  # forward and dq kernels: query rows per program
    block_k: int  # forward and dq kernels: keys per inner-loop step
    bwd_block_q: int  # dk/dv kernel: query rows per inner-loop step
    bwd_block_k: int  # dk/dv kernel: keys per program
    num_warps: int | None = None  # Triton, forward kernel (None: 4 for H <= 64, else 8)
    num_stages: int | None = None  # Triton, forward kernel (None: Triton's default)
    bwd_num_warps: int | None = None  # Triton, dq and dk/dv kernels (None: num_warps)
    bwd_num_stages: int | None = None  # Triton, dq and dk/dv kernels (None: num_stages)


BLOCKS = {
    "gpu": Blocks(block_q=128, block_k=64, bwd_block_q=64, bwd_block_k=64, num_stages=2),
    "tpu": Blocks(block_q=512, block_k=512, bwd_block_q=512, bwd_block_k=512),
    # Interpret mode on a CPU: small tiles keep the emulated grid cheap.
    "cpu": Blocks(block_q=64, block_k=64, bwd_block_q=64, bwd_block_k=64),
}

# Splash attention's tile (query and key blocks, forward and backward); its key
# blocks must be multiples of 128 (the TPU's lane count).
SPLASH_BLOCK = {"tpu": 512, "cpu": 128}

# Triton's dot needs every matmul dimension >= 16.
MIN_BLOCK = 16


def platform_blocks(platform: str) -> Blocks:
    """The table's entry for ``platform`` (unknown platforms get the GPU's)."""
    return BLOCKS.get(platform, BLOCKS["gpu"])


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def padded_head_dim(d: int) -> int:
    """A head dim as the compiled kernels hold it: a power of two, at least ``MIN_BLOCK``."""
    return max(next_power_of_2(d), MIN_BLOCK)


def fit_block(block: int, length: int, minimum: int = 1) -> int:
    """``block`` shrunk to the power of two covering ``length``, at least ``minimum``.

    A block longer than the sequence only adds padding; keeping it a power of
    two keeps Triton's tiles legal.
    """
    return max(min(block, next_power_of_2(length)), minimum)
