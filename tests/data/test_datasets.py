import numpy as np
import pytest

from bayesfuse.data import (
    FASHION_MNIST_DIR,
    Dataset,
    DataSplit,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    load_idx,
    load_mnist,
    write_idx,
)


def _write_fake_mnist(directory, n_train=12, n_test=5, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    suffix = ".gz" if gz else ""
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for stem, a in arrays.items():
        write_idx(directory / (stem + suffix), a)
    return arrays


def test_digits_split_and_range():
    split = load_digits()
    assert split.n_classes == 10 and split.n_features == 64
    assert len(split.train) + len(split.test) == 1797
    assert split.train.x.min() >= 0 and split.train.x.max() <= 1
    # Stratified: every class in both parts, proportions within one example of each other.
    assert (split.test.class_counts() > 0).all()
    frac = split.test.class_counts() / split.train.class_counts()
    assert frac.max() - frac.min() < 0.05


def test_standardisation_uses_train_statistics_only():
    split = load_digits().standardize()
    x = split.train.x
    varying = x.std(0) > 0
    np.testing.assert_allclose(x.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(0)[varying], 1, rtol=1e-4)
    # The test part is transformed with the same mean/scale, not its own.
    raw = load_digits()
    expected = (raw.test.x - split.standardizer.mean) / split.standardizer.scale
    np.testing.assert_allclose(split.test.x, expected, rtol=1e-6)
    assert not np.allclose(split.test.x.mean(0)[varying], 0, atol=1e-3)
    with pytest.raises(RuntimeError, match="already"):
        split.standardize()


def test_dataset_validation():
    with pytest.raises(ValueError, match="NaN"):
        Dataset(np.array([[np.nan, 1.0]]), np.array([0]), 2)
    with pytest.raises(ValueError, match="labels"):
        Dataset(np.zeros((2, 3)), np.array([0, 5]), 2)
    with pytest.raises(ValueError, match="shape"):
        Dataset(np.zeros((2, 3)), np.array([0]), 2)
    with pytest.raises(ValueError, match="features"):
        DataSplit(Dataset(np.zeros((2, 3)), np.array([0, 1]), 2), Dataset(np.zeros((2, 4)), np.array([0, 1]), 2))


@pytest.mark.parametrize("gz", [True, False])
def test_load_idx_directory(tmp_path, gz):
    arrays = _write_fake_mnist(tmp_path, gz=gz)
    split = load_idx(tmp_path)
    assert split.train.x.shape == (12, 784) and split.test.x.shape == (5, 784)
    assert split.train.image_shape == (28, 28)
    np.testing.assert_allclose(split.train.x[3] * 255, arrays["train-images-idx3-ubyte"][3].ravel(), atol=1e-3)
    np.testing.assert_array_equal(split.test.y, arrays["t10k-labels-idx1-ubyte"])


def test_missing_directory_names_path_and_remedy(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as err:
        load_fashion_mnist(missing)
    assert str(missing) in str(err.value)
    assert "apt-get install -y dataset-fashion-mnist" in str(err.value)


def test_missing_files_are_named(tmp_path):
    _write_fake_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)


def test_load_mnist_npz(tmp_path):
    rng = np.random.default_rng(1)
    np.savez(
        tmp_path / "mnist.npz",
        x_train=rng.integers(0, 256, (6, 28, 28), dtype=np.uint8),
        y_train=np.arange(6) % 10,
        x_test=rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        y_test=np.arange(3),
    )
    split = load_mnist(tmp_path / "mnist.npz")
    assert split.train.x.shape == (6, 784) and split.name == "mnist"
    np.savez(tmp_path / "bad.npz", x_train=np.zeros((2, 28, 28)))
    with pytest.raises(ValueError, match="lacks arrays"):
        load_mnist(tmp_path / "bad.npz")
    with pytest.raises(FileNotFoundError, match="does not download"):
        load_mnist(tmp_path / "absent.npz")


def test_load_dataset_by_name():
    assert load_dataset("digits").name == "digits"
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="path"):
        load_dataset("mnist")


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(), reason="Fashion-MNIST not installed (run `make data`)")
def test_real_fashion_mnist():
    split = load_fashion_mnist()
    assert split.train.x.shape == (60000, 784) and split.test.x.shape == (10000, 784)
    np.testing.assert_array_equal(split.train.class_counts(), np.full(10, 6000))
    np.testing.assert_array_equal(split.test.class_counts(), np.full(10, 1000))
    assert split.train.x.min() == 0.0 and split.train.x.max() == 1.0


@pytest.mark.parametrize("content, problem", [(b"not an archive", "not a zip archive"), (b"", "the file is empty")])
def test_load_mnist_names_a_file_that_is_no_npz(tmp_path, content, problem):
    path = tmp_path / "bogus.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"bogus.pt is not a readable MNIST .npz \({problem}\)"):
        load_mnist(path)
