"""Datasets: a small container with a train/test split and train-only standardisation.

Every loader returns a :class:`DataSplit`. Images are flattened to ``x`` of shape
``(n, height * width)`` as float32 in ``[0, 1]`` (ink is high, background 0), labels ``y`` are
int64 in ``0 .. n_classes - 1``. Nothing is ever downloaded: loaders read files that are already
on disk and say what to install when they are missing.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast, overload

import numpy as np

from bayesfuse.data.idx import read_idx

__all__ = [
    "Dataset",
    "DataSplit",
    "Standardizer",
    "load_digits",
    "load_idx",
    "load_fashion_mnist",
    "load_mnist",
    "load_dataset",
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_CLASSES",
]

#: Where the Debian package ``dataset-fashion-mnist`` installs the IDX files.
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_DIGIT_CLASSES = tuple(str(d) for d in range(10))
_IDX_STEMS = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True)
class Dataset:
    """Labelled examples.

    Attributes
    ----------
    x : ndarray of shape (n, d), float32
    y : ndarray of shape (n,), int64
    n_classes : int
    name : str
    image_shape : tuple of int or None
        ``(height, width)`` when the rows of ``x`` are flattened images.
    class_names : tuple of str
    """

    x: np.ndarray
    y: np.ndarray
    n_classes: int
    name: str = "dataset"
    image_shape: tuple[int, int] | None = None
    class_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        x = np.asarray(self.x, dtype=np.float32)
        y = np.asarray(self.y)
        if x.ndim != 2:
            raise ValueError(f"x must be 2-D (n, d), got shape {x.shape}")
        if y.shape != (x.shape[0],):
            raise ValueError(f"y must have shape ({x.shape[0]},) to match x, got {y.shape}")
        if not np.issubdtype(y.dtype, np.integer):
            raise TypeError(f"labels must be integers, got dtype {y.dtype}")
        if y.size and (y.min() < 0 or y.max() >= self.n_classes):
            raise ValueError(f"labels must lie in 0..{self.n_classes - 1}, got range {y.min()}..{y.max()}")
        if not np.isfinite(x).all():
            raise ValueError(f"{self.name}: x contains NaN or infinite values")
        if self.image_shape is not None and int(np.prod(self.image_shape)) != x.shape[1]:
            raise ValueError(f"image_shape {self.image_shape} does not match {x.shape[1]} features")
        object.__setattr__(self, "x", x)
        object.__setattr__(self, "y", y.astype(np.int64, copy=False))
        if not self.class_names:
            object.__setattr__(self, "class_names", tuple(str(k) for k in range(self.n_classes)))

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def n_features(self) -> int:
        return self.x.shape[1]

    def subset(self, index: np.ndarray) -> Dataset:
        """The examples at ``index`` (an integer or boolean array)."""
        return replace(self, x=self.x[index], y=self.y[index])

    def class_counts(self) -> np.ndarray:
        """Number of examples of each class, shape ``(n_classes,)``."""
        return np.bincount(self.y, minlength=self.n_classes)


@dataclass(frozen=True)
class Standardizer:
    """Per-feature affine map ``(x - mean) / scale`` fitted on training data only.

    Features that are constant on the training set (blank image borders) get ``scale = 1`` so
    they map to 0 instead of dividing by zero.
    """

    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray) -> Standardizer:
        x = np.asarray(x, dtype=np.float64)
        if x.shape[0] < 2:
            raise ValueError("need at least 2 examples to fit a standardisation")
        mean, std = x.mean(axis=0), x.std(axis=0)
        return cls(mean.astype(np.float32), np.where(std > 1e-8, std, 1.0).astype(np.float32))

    @overload
    def transform(self, data: Dataset) -> Dataset: ...
    @overload
    def transform(self, data: np.ndarray) -> np.ndarray: ...
    def transform(self, data: np.ndarray | Dataset) -> np.ndarray | Dataset:
        """Standardise an array or a :class:`Dataset` (returned as the same type)."""
        if isinstance(data, Dataset):
            return replace(data, x=self.transform(data.x))
        x = np.asarray(data, dtype=np.float32)
        if x.shape[-1] != self.mean.shape[0]:
            raise ValueError(f"expected {self.mean.shape[0]} features, got {x.shape[-1]}")
        return (x - self.mean) / self.scale


@dataclass(frozen=True)
class DataSplit:
    """A train/test pair, optionally standardised with statistics of ``train``.

    Attributes
    ----------
    train, test : Dataset
    standardizer : Standardizer or None
        Set by :meth:`standardize`; apply it to any other data (an OOD set) that is fed to
        models trained on this split.
    """

    train: Dataset
    test: Dataset
    standardizer: Standardizer | None = field(default=None)

    def __post_init__(self) -> None:
        if self.train.n_features != self.test.n_features:
            raise ValueError(f"train has {self.train.n_features} features but test has {self.test.n_features}")
        if self.train.n_classes != self.test.n_classes:
            raise ValueError("train and test disagree on the number of classes")

    @property
    def name(self) -> str:
        return self.train.name

    @property
    def n_classes(self) -> int:
        return self.train.n_classes

    @property
    def n_features(self) -> int:
        return self.train.n_features

    def standardize(self) -> DataSplit:
        """Standardise both parts with mean and scale fitted on ``train`` alone."""
        if self.standardizer is not None:
            raise RuntimeError("this split is already standardised")
        scaler = Standardizer.fit(self.train.x)
        return DataSplit(scaler.transform(self.train), scaler.transform(self.test), scaler)

    def __repr__(self) -> str:
        std = ", standardised" if self.standardizer is not None else ""
        return (
            f"DataSplit({self.name!r}: {len(self.train)} train / {len(self.test)} test, "
            f"{self.n_features} features, {self.n_classes} classes{std})"
        )


def load_digits(*, test_size: float = 0.25, seed: int = 0) -> DataSplit:
    """scikit-learn's 8x8 handwritten digits (1,797 images), the embedded default dataset.

    Pixel values 0..16 are scaled to [0, 1]. The split is stratified by class.
    """
    from sklearn.datasets import load_digits as _sk_load_digits
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_size < 1.0:
        raise ValueError(f"test_size must lie in (0, 1), got {test_size}")
    bunch = _sk_load_digits()
    x = bunch.data.astype(np.float32) / 16.0
    y = bunch.target.astype(np.int64)
    i_train, i_test = train_test_split(np.arange(len(y)), test_size=test_size, random_state=seed, stratify=y)
    full = Dataset(x, y, 10, name="digits", image_shape=(8, 8), class_names=_DIGIT_CLASSES)
    return DataSplit(full.subset(i_train), full.subset(i_test))


def _find_idx_file(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def _missing_data_message(what: str, searched: Path, hint: str) -> str:
    return f"{what} not found: searched {searched}. {hint}"


def load_idx(
    directory: str | os.PathLike,
    *,
    name: str = "idx",
    class_names: tuple[str, ...] = (),
    hint: str = "",
) -> DataSplit:
    """Load an MNIST-style directory of four IDX files (plain or ``.gz``).

    Expects ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``
    and ``t10k-labels-idx1-ubyte``; pixels are scaled to [0, 1].

    Raises
    ------
    FileNotFoundError
        Naming the directory searched and the files missing.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(_missing_data_message(f"{name} data directory", directory, hint))
    paths = {key: _find_idx_file(directory, stem) for key, stem in _IDX_STEMS.items()}
    missing = [_IDX_STEMS[k] + "[.gz]" for k, p in paths.items() if p is None]
    if missing:
        raise FileNotFoundError(_missing_data_message(f"{name} IDX files {', '.join(missing)}", directory, hint))
    arrays = {key: read_idx(cast(Path, p)) for key, p in paths.items()}  # none missing
    return _split_from_arrays(arrays, name=name, class_names=class_names)


def _split_from_arrays(arrays: dict[str, np.ndarray], *, name: str, class_names: tuple[str, ...]) -> DataSplit:
    x_train, x_test = arrays["x_train"], arrays["x_test"]
    if x_train.ndim != 3 or x_test.ndim != 3 or x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"{name}: expected image arrays (n, h, w), got {x_train.shape} and {x_test.shape}")
    y_train, y_test = arrays["y_train"].astype(np.int64), arrays["y_test"].astype(np.int64)
    n_classes = int(max(y_train.max(), y_test.max())) + 1
    shape = x_train.shape[1:]
    scale = 255.0 if x_train.dtype == np.uint8 else 1.0

    def make(x: np.ndarray, y: np.ndarray) -> Dataset:
        x = x.reshape(len(x), -1).astype(np.float32) / scale
        return Dataset(x, y, n_classes, name=name, image_shape=shape, class_names=class_names)

    return DataSplit(make(x_train, y_train), make(x_test, y_test))


def load_fashion_mnist(directory: str | os.PathLike | None = None) -> DataSplit:
    """Fashion-MNIST (60,000 train / 10,000 test 28x28 images, 10 classes) from local IDX files.

    The default directory is where Debian's ``dataset-fashion-mnist`` package puts them
    (``make data`` installs it).
    """
    return load_idx(
        FASHION_MNIST_DIR if directory is None else directory,
        name="fashion-mnist",
        class_names=FASHION_MNIST_CLASSES,
        hint="Install it with `sudo apt-get install -y dataset-fashion-mnist` (or `make data`), "
        "or pass the directory holding the four IDX files.",
    )


def load_mnist(path: str | os.PathLike) -> DataSplit:
    """MNIST from a directory of IDX files or from an ``.npz`` with ``x_train, y_train, x_test, y_test``.

    A ``path`` that is a file is read as an ``.npz`` whatever its suffix (a ValueError naming it if it is not one).

    bayesfuse never downloads data; point ``path`` at files you already have.
    """
    path = Path(path)
    hint = (
        "bayesfuse does not download data: pass a directory with the four MNIST IDX files "
        "or an mnist.npz holding x_train, y_train, x_test, y_test."
    )
    if path.suffix == ".npz" or path.is_file():  # a file is read as an .npz whatever its name
        if not path.is_file():
            raise FileNotFoundError(_missing_data_message("MNIST .npz file", path, hint))
        return _split_from_arrays(_read_mnist_npz(path), name="mnist", class_names=_DIGIT_CLASSES)
    return load_idx(path, name="mnist", class_names=_DIGIT_CLASSES, hint=hint)


_NPZ_EXPECTED = (
    "expected a NumPy .npz archive (numpy.savez) holding the arrays x_train, y_train, x_test, y_test, "
    "such as Keras' mnist.npz, or a directory of the four MNIST IDX files; bayesfuse does not download data"
)
#: What a damaged .npz raises: no zip (numpy then tries pickle), a truncated or corrupt archive.
_NPZ_ERRORS = (ValueError, EOFError, zipfile.BadZipFile, zlib.error)


def _npz_problem(err: Exception) -> str:
    """What is wrong with an .npz, in words (not numpy's advice to unpickle it)."""
    if isinstance(err, EOFError):
        return "the file is empty"
    if isinstance(err, ValueError) and "pickle" in str(err):
        return "not a zip archive"
    return f"damaged or truncated: {err}"


def _read_mnist_npz(path: Path) -> dict[str, np.ndarray]:
    """The four MNIST arrays of an .npz.

    Raises
    ------
    ValueError
        One message naming the file, what is wrong and what is expected.
    """
    try:
        loaded = np.load(path, allow_pickle=False)
    except _NPZ_ERRORS as err:
        raise ValueError(f"{path} is not a readable MNIST .npz ({_npz_problem(err)}); {_NPZ_EXPECTED}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} holds a single array, not an archive; {_NPZ_EXPECTED}")
    with loaded as npz:
        missing = [k for k in _IDX_STEMS if k not in npz.files]
        if missing:
            raise ValueError(f"{path} lacks arrays {missing}; it holds {npz.files}; {_NPZ_EXPECTED}")
        try:
            return {k: npz[k] for k in _IDX_STEMS}
        except _NPZ_ERRORS as err:
            raise ValueError(f"{path} is not a readable MNIST .npz ({_npz_problem(err)}); {_NPZ_EXPECTED}") from None


def load_dataset(name: str, *, seed: int = 0, path: str | os.PathLike | None = None) -> DataSplit:
    """Load a dataset by name: ``digits``, ``fashion-mnist`` or ``mnist`` (needs ``path``)."""
    key = name.lower().replace("_", "-")
    if key == "digits":
        return load_digits(seed=seed)
    if key in ("fashion-mnist", "fashion"):
        return load_fashion_mnist(path)
    if key == "mnist":
        if path is None:
            raise ValueError(
                "mnist needs a path to local IDX files or an .npz (nothing is downloaded): give it with "
                "--data-path on the command line, path= in Python"
            )
        return load_mnist(path)
    raise ValueError(f"unknown dataset {name!r}; choose digits, fashion-mnist or mnist")
