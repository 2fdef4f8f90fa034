import numpy as np
import pytest

from bayesfuse.inference.lazy import GroupedColumns, LazyRows


def _pair(n=7, d=5, **kw):
    dense = np.random.default_rng(3).normal(size=(n, d))
    calls = []

    def rows(index):
        calls.append(index)
        return dense[index]

    return dense, LazyRows((n, d), rows, **kw), calls


@pytest.mark.parametrize(
    "key",
    [
        2,
        -1,
        np.int64(3),
        slice(1, 5),
        slice(None, None, -2),
        (slice(2, 6), 3),
        (4, slice(1, 3)),
        np.array([5, 0, 5]),
        np.array([True, False, True, False, False, True, False]),
        (np.array([1, 2]), np.array([0, 4])),
        (Ellipsis, 1),
        (slice(None), None),
    ],
)
def test_indexing_reads_what_the_dense_array_reads(key):
    dense, lazy, _ = _pair()
    np.testing.assert_array_equal(lazy[key], dense[key])


def test_an_index_of_rows_computes_only_those_rows():
    _, lazy, calls = _pair()
    lazy[3, 2]
    assert len(calls) == 1 and list(np.atleast_1d(calls[0])) == [3]


def test_it_is_an_array_to_numpy_functions_ufuncs_and_operators():
    dense, lazy, _ = _pair(max_elements=10)  # blocks of two rows: the blocks are put together right
    np.testing.assert_array_equal(np.asarray(lazy), dense)
    np.testing.assert_array_equal(lazy * 2 - 1, dense * 2 - 1)
    np.testing.assert_array_equal(1 / lazy, 1 / dense)
    np.testing.assert_array_equal(np.sqrt(np.abs(lazy)), np.sqrt(np.abs(dense)))
    assert np.sum(lazy) == np.sum(dense) and np.max(lazy, axis=0).tolist() == dense.max(axis=0).tolist()
    np.testing.assert_array_equal(np.concatenate([lazy, lazy]), np.concatenate([dense, dense]))
    np.testing.assert_array_equal(lazy.T, dense.T)
    np.testing.assert_array_equal(np.stack(list(lazy)), dense)
    assert (lazy.shape, lazy.ndim, lazy.dtype, len(lazy), lazy.size) == (dense.shape, 2, np.float64, 7, 35)
    assert lazy.astype(np.float32).dtype == np.float32 and isinstance(lazy.copy(), np.ndarray)


def test_it_is_read_only_and_checks_its_bounds():
    dense, lazy, _ = _pair()
    with pytest.raises(TypeError, match="read-only"):
        lazy[0] = 1.0
    with pytest.raises(TypeError, match="read-only"):
        np.add(dense, 1.0, out=(lazy,))
    with pytest.raises(IndexError, match="out of bounds"):
        lazy[7]
    with pytest.raises(IndexError, match="boolean index"):
        lazy[np.array([True, False])]
    with pytest.raises(ValueError, match="without a copy"):
        np.asarray(lazy, copy=False)
    assert "computed when read" in repr(lazy)


@pytest.mark.parametrize(
    "key",
    [
        (slice(None), slice(1, 4)),
        (slice(None), np.array([0, 2, 2])),
        (slice(None), 3),
        (np.array([1, 0]), 2),
        1,
        (slice(1, 3),),
    ],
)
def test_grouped_columns_read_as_their_dense_array(key):
    values = np.arange(8.0).reshape(4, 2)
    index = np.array([0, 1, 1, 0, 1])
    dense = values[:, index]
    x = GroupedColumns(values, index)
    np.testing.assert_array_equal(x[key], dense[key])
    np.testing.assert_array_equal(np.asarray(x), dense)
    assert x.columns(slice(1, 3)).tolist() == [1]


def test_masks_bounds_methods_and_pickling_read_as_numpy_does():
    import pickle

    dense, lazy, _ = _pair()
    np.testing.assert_array_equal(lazy[lazy > 0], dense[dense > 0])  # a mask of the whole array
    with pytest.raises(IndexError, match="out of bounds"):
        lazy[np.array([0, 7])]
    with pytest.raises(IndexError, match="out of bounds"):
        lazy[np.array([-8])]
    np.testing.assert_array_equal(lazy[np.array([-1])], dense[[-1]])
    assert lazy.max() == dense.max() and lazy.reshape(-1).tolist() == dense.reshape(-1).tolist()
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        getattr(lazy, "nonsense")  # noqa: B009 (the attribute lookup is what is tested)
    with pytest.raises(TypeError, match="read-only"):
        np.add.at(lazy, [0], 1.0)
    grouped = GroupedColumns(np.arange(6.0).reshape(3, 2), np.array([1, 0, 0, 1]))
    np.testing.assert_array_equal(np.asarray(pickle.loads(pickle.dumps(grouped))), np.asarray(grouped))
    row = grouped[0]
    row += 100  # a row read is the caller's copy, never the stored values
    np.testing.assert_array_equal(grouped.values, np.arange(6.0).reshape(3, 2))
