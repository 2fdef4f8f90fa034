"""Datasets (embedded digits, local IDX files, font-digit OOD set) and federated partitions."""

from bayesfuse.data.datasets import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_DIR,
    Dataset,
    DataSplit,
    Standardizer,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    load_idx,
    load_mnist,
)
from bayesfuse.data.fonts import DEFAULT_FONTS, available_fonts, load_font_digits
from bayesfuse.data.idx import read_idx, write_idx
from bayesfuse.data.partition import Partition, dirichlet_partition, holdout_partition, homogeneous_partition

__all__ = [
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIR",
    "DEFAULT_FONTS",
    "Dataset",
    "DataSplit",
    "Partition",
    "Standardizer",
    "available_fonts",
    "dirichlet_partition",
    "holdout_partition",
    "homogeneous_partition",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_font_digits",
    "load_idx",
    "load_mnist",
    "read_idx",
    "write_idx",
]
