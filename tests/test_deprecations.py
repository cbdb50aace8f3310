"""Every renamed public name still works until attnlab 0.2, and says what replaces it.

One place lists them all (the closing note of the structure issue names each):
the old name gives what the new one gives, with a ``DeprecationWarning`` that
names the replacement and the release that removes the old one.
"""

import importlib
import sys

import jax.numpy as jnp
import pytest

import attn
import models
import train.loop
import train.optimizer
import train.steps
from tests.util import qkv

OLD = "removed in attnlab 0.2"


@pytest.mark.parametrize(
    ("get", "new", "names"),
    [
        (lambda: attn.FORMS, lambda: attn.LINEAR_FORMS, "attn.LINEAR_FORMS"),
        (lambda: attn.linear.FORMS, lambda: attn.LINEAR_FORMS, "attn.LINEAR_FORMS"),
        (lambda: attn.errors.fail, lambda: attn.checks.fail, "attn.checks"),
        (lambda: models.PRESETS["gqa"], lambda: models.presets()["gqa"], "models.presets()"),
        (lambda: models.MASK_FIELDS, lambda: models.KINDS["softmax"].fields[:7], "fields"),
        (lambda: models.patterns.Presets, lambda: type(models.presets()), "models.presets"),
        (lambda: train.loop.make_optimizer, lambda: train.optimizer.make_optimizer, "optimizer"),
        (lambda: train.loop.weighted_metrics, lambda: train.steps.weighted_metrics, "steps"),
        (lambda: train.loop.build_model, lambda: train.steps.build_model, "train.steps"),
    ],
)
def test_old_names_give_the_new_ones_with_a_warning(get, new, names):
    with pytest.warns(DeprecationWarning, match=OLD) as caught:
        old = get()
    assert names in str(caught[0].message)
    if isinstance(old, tuple):
        assert set(old) <= set(new()) | {"score", "rotary_dim"}
    else:
        assert old == new()


def test_the_old_error_module_imports_with_a_warning():
    sys.modules.pop("attn.errors", None)
    with pytest.warns(DeprecationWarning, match="attn.checks"):
        module = importlib.import_module("attn.errors")
    assert module.fail is attn.checks.fail


def test_decode_impl_xla_meant_dense():
    q, k, v = qkv(3, B=2, T=1, S=12, N=2)
    lengths = jnp.asarray([12, 5])
    with pytest.warns(DeprecationWarning, match="impl='dense'"):
        old = attn.decode_attention(q, k, v, lengths=lengths, impl="xla")
    assert (old == attn.decode_attention(q, k, v, lengths=lengths, impl="dense")).all()


def test_register_kind_fields_picks_the_class_that_holds_them(scratch):
    class Local(models.SelfAttention):
        pass

    with pytest.warns(DeprecationWarning, match=r"register_kind\(config="):
        models.register_kind("test_old_fields", Local, fields=("window", "impl", "score"))
    scratch.append((models.KINDS, "test_old_fields"))
    assert models.KINDS["test_old_fields"].config_class is models.SoftmaxConfig
    with pytest.warns(DeprecationWarning, match="AttentionConfig"):
        layer = models.AttentionConfig(kind="test_old_fields", window=4)
    assert layer == models.SoftmaxConfig(kind="test_old_fields", window=4)
