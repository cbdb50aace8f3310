"""Test-wide settings: float32 comparisons use full-precision matmuls."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
