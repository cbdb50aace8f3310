"""A row's logits do not depend on what else is in its batch, for every layer kind.

Beside another row of the same batch shape, a row's logits are the same bits
whatever that row holds, NaN included (an embedding row set to NaN, read only
by the other row): nothing crosses rows. Alone (a batch of one) they equal
float32 rounding, since another batch shape may round a matmul otherwise.
The decoders of ``common.KINDS`` cover every registered layer kind.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from tests.models.common import KINDS, MAX_LEN, REGISTRY, VOCAB, forward, model_for, tokens
from tests.util import rel_err

BAD = VOCAB - 1  # the token id whose embedding holds NaN, which only the other rows read


def _row(seed):
    return tokens(seed, (1, MAX_LEN)) % BAD


def test_the_kinds_cover_every_registered_layer_kind():
    used = {REGISTRY[name].kind for names in KINDS.values() for name in names}
    assert used == set(models.KINDS)


@pytest.mark.integration  # 17 decoders: about 10 s, beside the fast tier's 4 minutes
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_rows_logits_are_the_same_bits_beside_any_other_row(kind):
    model = nnx.clone(model_for(KINDS[kind]))
    table = model.embed.embedding[...]
    model.embed.embedding.set_value(table.at[BAD].set(jnp.nan))
    row = _row(1)
    want = forward(model, jnp.concatenate([row, _row(2)]))
    # A tied output head scores token BAD by its NaN embedding in every row: that column only.
    assert np.isfinite(want[..., :BAD]).all()
    for other in (_row(3), jnp.full((1, MAX_LEN), BAD, jnp.int32), _row(3).at[0, 7].set(BAD)):
        got = forward(model, jnp.concatenate([row, other]))
        np.testing.assert_array_equal(got[0], want[0])
    assert np.isnan(got[1, 7:]).all()  # the other row did read NaN


@pytest.mark.integration
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_rows_logits_alone_equal_its_logits_in_a_batch(kind):
    """A batch of one against a batch of three (other shapes: float32 rounding)."""
    model = model_for(KINDS[kind])
    rows = jnp.concatenate([_row(4), _row(5), _row(6)])
    batch = forward(model, rows)
    for b in range(3):
        assert rel_err(forward(model, rows[b : b + 1])[0], batch[b]) <= 1e-5, b
