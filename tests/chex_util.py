"""A ``chex.TestCase`` that also checks its variants really run jitted or eagerly."""

from __future__ import annotations

import chex
import jax


class VariantTestCase(chex.TestCase):
    """Tests wrapped in ``@chex.variants(with_jit=True, without_jit=True)``.

    ``self.traced_variant(fn)`` is ``self.variant(fn)`` that records, on every
    call of ``fn``'s body, whether its arguments were tracers. ``tearDown``
    checks that the body ran, traced under the jit variant and on concrete
    arrays otherwise, so a variant cannot silently test the other one twice.
    """

    def setUp(self):
        super().setUp()
        self._traced = None

    def traced_variant(self, fn, **variant_kwargs):
        if self._traced is None:
            self._traced = []

        def body(*args, **kwargs):
            leaves = jax.tree.leaves((args, kwargs))
            self._traced.append(any(isinstance(x, jax.core.Tracer) for x in leaves))
            return fn(*args, **kwargs)

        return self.variant(body, **variant_kwargs)

    def tearDown(self):
        if self._traced is not None:
            assert self._traced, "traced_variant was created but never called"
            jitted = self.variant.type is chex.ChexVariantType.WITH_JIT
            assert all(t == jitted for t in self._traced), (self.variant.type, self._traced)
        super().tearDown()
