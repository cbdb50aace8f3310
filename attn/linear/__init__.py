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
* ``segments``: what segment ids (packing, padding) mean to a recurrence;
* ``features``: the feature maps ``phi`` (the ``FEATURE_MAPS`` registry, which
  ``register_feature_map`` adds to) and FAVOR+'s projection.
"""

from attn.deprecation import deprecated_names
from attn.linear.attention import (
    LINEAR_FORMS,
    LinearState,
    init_linear_state,
    linear_attention,
    linear_attention_step,
)
from attn.linear.delta import DELTA_FORMS, delta_rule, delta_rule_step, init_delta_state
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

__all__ = [
    "DELTA_FORMS",
    "EXP_KERNEL_MAPS",
    "FEATURE_MAPS",
    "LINEAR_FORMS",
    "LinearState",
    "delta_rule",
    "delta_rule_step",
    "elu1",
    "favor",
    "favor_projection",
    "identity",
    "init_delta_state",
    "init_linear_state",
    "linear_attention",
    "linear_attention_step",
    "linear_feature_dim",
    "register_feature_map",
    "relu",
    "taylor",
]

# Deprecated names (removed in attnlab 0.2).
__getattr__ = deprecated_names(__name__, {"FORMS": ("attn.LINEAR_FORMS", lambda: LINEAR_FORMS)})
