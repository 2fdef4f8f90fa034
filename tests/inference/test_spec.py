"""Permutation specs as data: shapes, checks and the global basis."""

import numpy as np
import pytest

from bayesfuse.inference.spec import Axis, chain, dense, to_global_basis


def test_to_global_basis_places_units_and_marks_missing():
    a = np.arange(12.0).reshape(2, 3, 2)  # axis 1: 3 units, inner 2
    out = to_global_basis(a.reshape(2, 6), 1, Axis("P", inner=2), np.array([4, 0, 2]), 5)
    assert out.shape == (2, 10)
    blocks = out.reshape(2, 5, 2)
    np.testing.assert_array_equal(blocks[:, 4], a[:, 0])
    np.testing.assert_array_equal(blocks[:, 0], a[:, 1])
    assert np.isnan(blocks[:, [1, 3]]).all()


def test_spec_check_names_entry_and_shapes():
    spec = chain(dense("a", None, "P"), dense("b", "P", None))
    good = {"a.weight": np.zeros((5, 3)), "a.bias": np.zeros(5), "b.weight": np.zeros((2, 5)), "b.bias": np.zeros(2)}
    assert spec.sizes(good) == {"P": 5}
    bad = dict(good, **{"b.weight": np.zeros((2, 6))})
    with pytest.raises(ValueError, match=r"group P has 6 units in 'b.weight'"):
        spec.check(bad)
    with pytest.raises(ValueError, match="lacks entries"):
        spec.check({k: v for k, v in good.items() if k != "a.bias"})
