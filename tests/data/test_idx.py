import gzip

import numpy as np
import pytest

from bayesfuse.data import read_idx, write_idx


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        np.array([3, 1, 4, 1, 5], dtype=np.uint8),
        np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
        np.array([[-7, 300000]], dtype=np.int32),
        np.array([1.5, -2.25], dtype=np.float64),
    ],
)
def test_round_trip(tmp_path, array, suffix):
    path = write_idx(tmp_path / f"a-idx{suffix}", array)
    back = read_idx(path)
    assert back.dtype == array.dtype
    np.testing.assert_array_equal(back, array)


def test_header_is_the_mnist_layout(tmp_path):
    # Magic 0x00000803 for a 3-D uint8 array, then big-endian sizes, as in the MNIST files.
    path = write_idx(tmp_path / "x", np.zeros((2, 28, 28), dtype=np.uint8))
    raw = path.read_bytes()
    assert raw[:4] == b"\x00\x00\x08\x03"
    assert raw[4:16] == (2).to_bytes(4, "big") + (28).to_bytes(4, "big") + (28).to_bytes(4, "big")
    assert len(raw) == 16 + 2 * 28 * 28


def test_gz_suffix_writes_gzip(tmp_path):
    path = write_idx(tmp_path / "x.gz", np.ones(3, dtype=np.uint8))
    assert gzip.decompress(path.read_bytes())[:4] == b"\x00\x00\x08\x01"


def test_refuses_to_overwrite(tmp_path):
    path = write_idx(tmp_path / "x", np.ones(3, dtype=np.uint8))
    with pytest.raises(FileExistsError):
        write_idx(path, np.zeros(3, dtype=np.uint8))
    np.testing.assert_array_equal(read_idx(path), np.ones(3))
    write_idx(path, np.zeros(3, dtype=np.uint8), overwrite=True)
    np.testing.assert_array_equal(read_idx(path), np.zeros(3))


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        read_idx(tmp_path / "missing")
    (tmp_path / "junk").write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "junk")
    good = write_idx(tmp_path / "t", np.zeros((4, 5), dtype=np.uint8)).read_bytes()
    (tmp_path / "short").write_bytes(good[:-3])
    with pytest.raises(ValueError, match="holds 17 bytes"):
        read_idx(tmp_path / "short")


def test_unsupported_dtype(tmp_path):
    with pytest.raises(TypeError, match="cannot store"):
        write_idx(tmp_path / "x", np.zeros(2, dtype=np.int64))
