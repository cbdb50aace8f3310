"""Fused accelerator kernels (Pallas) that read the same ``Mask`` objects as ``attn``.

* ``flash_attention``: FlashAttention-2 forward and backward written in Pallas
  (GPU through Triton; on a CPU, Pallas's interpreter with ``interpret=True``), for every
  mask of the algebra.
* ``splash_attention``: our masks mapped onto JAX's TPU splash-attention kernel,
  refusing, with the reason, what does not map.

Both compute ``attn.dot_product_attention``'s function; ``attn.attention``
chooses them with ``impl="pallas"`` and ``impl="splash"`` (and on GPUs and TPUs
with ``impl="auto"``).

``attn.pallas.mosaic.mosaic_attention`` (imported on its own: it loads Pallas's
Mosaic GPU) is the same function as Hopper kernels in the Mosaic GPU API,
forward and backward, each with a twin that its interpreter runs on a CPU.

None of them runs its interpreter unless ``interpret=True``: on a backend where a
kernel is not compiled, ``interpret=None`` (the default) raises a ``ValueError``
naming it, and ``impl="auto"`` picks only compiled forms.
"""

from attn.pallas.blocks import BLOCKS, SPLASH_BLOCK
from attn.pallas.flash import flash_attention
from attn.pallas.splash import splash_attention, splash_reason

__all__ = ["BLOCKS", "SPLASH_BLOCK", "flash_attention", "splash_attention", "splash_reason"]
