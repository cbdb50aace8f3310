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
* ``front``: the arguments every recurrence takes (``RecurrenceArgs``), checked
  once (``check_front``), and the one default ``CHUNK_SIZE``;
* ``family``: a family as one record (``Family``), the registry of them
  (``FAMILIES``) and the one driver that shards any of them (``sharded``);
* ``log_linear_family``: the log-linear records (no sharded form);
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

from attn.linear import log_linear_family  # noqa: F401  (adds its records)
from attn.linear.attention import (
    LINEAR_FORMS,
    LinearState,
    init_linear_state,
    linear_attention,
    linear_attention_step,
)
from attn.linear.comba import COMBA_FORMS, comba, comba_step, sharded_comba
from attn.linear.delta import DELTA_FORMS, delta_rule, delta_rule_step, init_delta_state
from attn.linear.dplr import DPLR_FORMS, dplr_delta_rule, dplr_delta_rule_step
from attn.linear.features import (
    EXP_KERNEL_MAPS,
    FEATURE_MAPS,
    elu1,
    favor,
    favor_projection,
    identity,
    linear_feature_dim,
    register_feature_map,
    relu,
    taylor,
)
from attn.linear.front import CHUNK_SIZE
from attn.linear.log_linear import (
    LOG_LINEAR_DELTA_FORMS,
    LOG_LINEAR_FORMS,
    LogLinearState,
    init_log_linear_state,
    log_linear_attention,
    log_linear_attention_step,
    log_linear_delta_rule,
    log_linear_delta_rule_step,
)
from attn.linear.mamba import SSD_FORMS, init_ssd_state, ssd, ssd_decay, ssd_step
from attn.linear.product import delta_product, delta_product_step
from attn.linear.sharded import (
    FAMILIES,
    sharded_delta_product,
    sharded_delta_rule,
    sharded_dplr_delta_rule,
    sharded_linear_attention,
    sharded_short_conv,
    sharded_ssd,
)

__all__ = [
    "CHUNK_SIZE",
    "COMBA_FORMS",
    "DELTA_FORMS",
    "DPLR_FORMS",
    "EXP_KERNEL_MAPS",
    "FAMILIES",
    "FEATURE_MAPS",
    "LINEAR_FORMS",
    "LOG_LINEAR_DELTA_FORMS",
    "LOG_LINEAR_FORMS",
    "SSD_FORMS",
    "LinearState",
    "LogLinearState",
    "comba",
    "comba_step",
    "delta_product",
    "delta_product_step",
    "delta_rule",
    "delta_rule_step",
    "dplr_delta_rule",
    "dplr_delta_rule_step",
    "elu1",
    "favor",
    "favor_projection",
    "identity",
    "init_delta_state",
    "init_linear_state",
    "init_log_linear_state",
    "init_ssd_state",
    "linear_attention",
    "linear_attention_step",
    "linear_feature_dim",
    "log_linear_attention",
    "log_linear_attention_step",
    "log_linear_delta_rule",
    "log_linear_delta_rule_step",
    "register_feature_map",
    "relu",
    "sharded_comba",
    "sharded_delta_product",
    "sharded_delta_rule",
    "sharded_dplr_delta_rule",
    "sharded_linear_attention",
    "sharded_short_conv",
    "sharded_ssd",
    "ssd",
    "ssd_decay",
    "ssd_step",
    "taylor",
]
