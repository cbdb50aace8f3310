"""Linear attention: softmax(q.k) replaced by a kernel phi(q).phi(k), in three equal forms.

Modules:

* ``attention``: the entry points ``linear_attention`` (``LINEAR_FORMS``: ``"parallel"``,
  ``"recurrent"``, ``"chunkwise"``; decay and gates; initial and final
  states; segment ids) and ``linear_attention_step`` (one token, for
  decoding), with ``LinearState``; its docstring states the math;
* ``forms``: the three forms (and the non-causal global sums);
* ``delta``: the delta rule (DeltaNet, Gated DeltaNet, KDA): ``delta_rule``
  (forms ``"recurrent"`` and ``"chunkwise"``, in ``delta_forms``) and
  ``delta_rule_step``;
* ``dplr``: the DPLR delta rule (RWKV-7's diagonal-plus-low-rank transition):
  ``dplr_delta_rule`` (``DPLR_FORMS``, in ``dplr_forms``) and
  ``dplr_delta_rule_step``;
* ``comba``: Comba (the delta rule with closed-loop control) as the DPLR rule
  it is: ``comba``, ``comba_step``, ``sharded_comba`` (its record is its own);
* ``log_linear``: log-linear attention (Guo et al. 2025), gated linear attention
  over a Fenwick tree of states: ``log_linear_attention`` (``LOG_LINEAR_FORMS``,
  in ``log_linear_forms``) and ``log_linear_attention_step``; log-linear Gated
  DeltaNet: ``log_linear_delta_rule`` (``LOG_LINEAR_DELTA_FORMS``, in
  ``log_linear_delta_forms``) and ``log_linear_delta_rule_step``;
* ``mamba``: Mamba-2's SSD layer as the gated linear attention it is:
  ``ssd`` (forms ``SSD_FORMS``: recurrent, chunkwise, quadratic; negative
  eigenvalues), ``ssd_step``;
* ``product``: DeltaProduct, several delta-rule steps per token:
  ``delta_product``, ``delta_product_step``;
* ``ttt``: TTT-Linear and TTT-MLP (Sun et al. 2024), a model trained at test time
  a mini-batch at a time: ``ttt_linear`` and ``ttt_mlp`` (``TTT_FORMS``: dual,
  primal, recurrent), their steps, ``TTTState``, ``ttt_zero_state``;
* ``titans``: Titans' memory (Behrouz et al. 2025), the same inner models trained
  with momentum and weight decay: ``titans``, ``titans_step``, ``TitansState``,
  ``titans_zero_state``;
* ``mesa``: MesaNet (von Oswald et al. 2025), the state's least-squares solve at every
  token, exact or by conjugate gradients: ``mesa_net`` (``MESA_FORMS``), ``mesa_net_step``,
  ``MesaState``, ``init_mesa_state``;
* ``ttt_forms``, ``inner``: those families' forms (one dual, one primal, one
  recurrent form over each family's rule) and the driver they share (checks, the
  segments' mini-batch grid); their states are nonlinear in their past, so they
  have no sharded form;
* ``front``: the arguments every recurrence takes (``RecurrenceArgs``), checked
  once (``check_front``), and the one default ``CHUNK_SIZE``;
* ``family``: a family as one record (``Family``), the registry of them
  (``FAMILIES``) and the one driver that shards any of them (``sharded``);
* ``log_linear_family``: the log-linear records (no sharded form);
* ``ttt_family``: TTT-Linear's, TTT-MLP's and Titans' records (no sharded form);
* ``sharded``: the first six records and every family (and ``attn.conv``'s
  short convolution) with the sequence split over a mesh axis:
  ``sharded_linear_attention``, ``sharded_delta_rule``, ``sharded_delta_product``,
  ``sharded_dplr_delta_rule``, ``sharded_ssd``, ``sharded_short_conv``; ``chain``
  drives them (the states chained across devices, a backward pass of its own)
  and ``drive`` takes whole arrays to it;
* ``segments``: what segment ids (packing, padding) mean to a recurrence;
* ``features``: the feature maps ``phi`` (the ``FEATURE_MAPS`` registry, which
  ``register_feature_map`` adds to) and FAVOR+'s projection.
"""

# Each family's module lists its public names (``__all__``); they are this
# package's and ``attn``'s: a new family adds its import and its module's name here, none there.
# The names imported ``X as X`` are this package's only, not lifted to ``attn``.
import importlib

from attn.linear import log_linear_family, ttt_family  # noqa: F401  (add their records)
from attn.linear.attention import *  # noqa: F403
from attn.linear.comba import *  # noqa: F403
from attn.linear.delta import *  # noqa: F403
from attn.linear.dplr import *  # noqa: F403
from attn.linear.family import FAMILIES as FAMILIES
from attn.linear.features import EXP_KERNEL_MAPS as EXP_KERNEL_MAPS
from attn.linear.features import (
    FEATURE_MAPS,
    favor_projection,
    linear_feature_dim,
    register_feature_map,
)
from attn.linear.features import elu1 as elu1
from attn.linear.features import favor as favor
from attn.linear.features import identity as identity
from attn.linear.features import relu as relu
from attn.linear.features import taylor as taylor
from attn.linear.front import CHUNK_SIZE as CHUNK_SIZE
from attn.linear.log_linear import *  # noqa: F403
from attn.linear.mamba import *  # noqa: F403
from attn.linear.mesa import *  # noqa: F403
from attn.linear.product import *  # noqa: F403
from attn.linear.sharded import *  # noqa: F403
from attn.linear.titans import *  # noqa: F403
from attn.linear.ttt import *  # noqa: F403

# By module name: the function ``comba`` has taken the name of its module here.
FAMILY_MODULES = (
    "attention",
    "comba",
    "delta",
    "dplr",
    "log_linear",
    "mamba",
    "mesa",
    "product",
    "sharded",
    "titans",
    "ttt",
)
__all__ = [
    *(n for m in FAMILY_MODULES for n in importlib.import_module(f"attn.linear.{m}").__all__),
    "FEATURE_MAPS",
    "favor_projection",
    "linear_feature_dim",
    "register_feature_map",
]
