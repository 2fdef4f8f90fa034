import numpy as np
import pytest

from bayesfuse.inference.moments import pool_moments


def _reply(values: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """(n, mean, mean square) per column of ``values``, as a client reports them."""
    return len(values), values.mean(0), (values**2).mean(0)


def test_pooled_moments_are_those_of_the_pooled_data():
    # exact identity: clients of different sizes and means pool to the moments of their union
    rng = np.random.default_rng(0)
    parts = [rng.normal(loc, scale, size=(n, 3)) for loc, scale, n in ((0.0, 1.0, 5), (2.0, 0.5, 40), (-1.0, 3.0, 11))]
    pooled = pool_moments([{"bn": _reply(p), "bn2": _reply(2 * p)} for p in parts])
    union = np.concatenate(parts)
    np.testing.assert_allclose(pooled["bn"][0], union.mean(0), rtol=1e-12)
    np.testing.assert_allclose(pooled["bn"][1], union.var(0), rtol=1e-12)
    np.testing.assert_allclose(pooled["bn2"][1], 4 * union.var(0), rtol=1e-12)
    # client order does not matter; one client pools to itself
    backwards = pool_moments([{"bn": _reply(p)} for p in parts[::-1]])
    np.testing.assert_allclose(backwards["bn"][1], pooled["bn"][1], rtol=1e-12)
    alone = pool_moments([{"bn": _reply(parts[1])}])
    np.testing.assert_allclose(alone["bn"][1], parts[1].var(0), rtol=1e-12)


def test_bad_replies_are_refused_naming_the_client():
    good = {"bn": _reply(np.ones((4, 2)))}
    with pytest.raises(ValueError, match="no client"):
        pool_moments([])
    with pytest.raises(ValueError, match=r"^client 1: moments of batch norms \['other'\]"):
        pool_moments([good, {"other": good["bn"]}])
    with pytest.raises(ValueError, match="^node 7: bn has a count of 0$"):
        pool_moments([good, {"bn": (0, np.ones(2), np.ones(2))}], names=["node 3", "node 7"])
    with pytest.raises(ValueError, match="^client 1: bn's moments are not finite"):
        pool_moments([good, {"bn": (3, np.array([np.nan, 0.0]), np.ones(2))}])
    with pytest.raises(ValueError, match="^client 1: bn has 3 channels, the others 2$"):
        pool_moments([good, {"bn": (3, np.zeros(3), np.ones(3))}])
    with pytest.raises(ValueError, match="below its mean squared"):
        pool_moments([{"bn": (3, np.full(2, 2.0), np.ones(2))}])


def test_matched_mean_is_the_mean_of_each_global_units_members():
    from bayesfuse.inference.moments import matched_mean

    values = [np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0])]
    assignments = [np.array([2, 0, 1]), np.array([0, 3])]
    # global 0: 2 and 10; 1: 3; 2: 1; 3: 20; 4: nobody
    np.testing.assert_allclose(
        matched_mean(values, assignments, 5, default=-1.0), [6.0, 3.0, 1.0, 20.0, -1.0], rtol=1e-15
    )
    # without assignments unit l is global unit l (FedAvg)
    np.testing.assert_allclose(matched_mean([np.ones(2), np.zeros(2)], None, 2, default=0.0), [0.5, 0.5])
    with pytest.raises(ValueError, match="client 1 has 2 values for 3 assigned units"):
        matched_mean(values, [assignments[0], np.arange(3)], 5, default=0.0)
    with pytest.raises(ValueError, match="outside the 3 global units"):
        matched_mean(values, assignments, 3, default=0.0)
