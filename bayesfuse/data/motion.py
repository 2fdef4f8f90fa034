"""BasicMotions smartwatch recordings as clients' activity sequences, for fused HMMs.

The UEA BasicMotions data (shipped with aeon; ``make data`` reads it out of the wheel, see
:mod:`bayesfuse.data.wheel_data`): 80 recordings of 10 s at 10 Hz of a smartwatch's 3-D
accelerometer and 3-D gyroscope (6 channels, 100 steps) while its wearer was standing, walking,
running or playing badminton, 20 of each. Each recording is one activity, so
:func:`motion_sessions` strings recordings into sessions that change activity, one session per
client, each client doing a subset of the activities: the heterogeneous setting of the paper's
section 5.2, with a true activity label at every step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from bayesfuse.constraints import POSITIVE_INT, validate_params
from bayesfuse.data.wheel_data import require

__all__ = ["MotionRecordings", "MotionSessions", "load_basic_motions", "motion_sessions"]


@dataclass(frozen=True)
class MotionRecordings:
    """``series`` (n, T, 6) float64, ``labels`` (n,) int into ``class_names``."""

    series: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]


@dataclass(frozen=True)
class MotionSessions:
    """One observation sequence per client with the true activity of each step.

    ``sequences[j]`` (T_j, 6), ``activities[j]`` (T_j,) int into ``class_names``,
    ``recordings[j]`` the recordings it strings together.
    """

    sequences: list[np.ndarray]
    activities: list[np.ndarray]
    recordings: list[np.ndarray]
    class_names: tuple[str, ...]


def _read_ts(path) -> tuple[list[np.ndarray], list[str], tuple[str, ...]]:
    """Recordings (T, D), labels and class names of a .ts file; a ValueError naming ``path`` if it is not one."""
    series: list[np.ndarray] = []
    labels: list[str] = []
    classes: tuple[str, ...] = ()
    in_data = False
    bad = f"{path} is not a valid .ts file"
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        raise ValueError(f"{bad}: it is not UTF-8 text") from None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not in_data:
            if line.lower().startswith("@classlabel"):
                classes = tuple(line.split()[2:])
            in_data = line.lower() == "@data"
            continue
        *dims, label = line.split(":")
        try:
            rec = np.array([[float(v) for v in d.split(",")] for d in dims]).T  # (T, D)
        except ValueError:
            rec = np.empty(0)
        if rec.ndim != 2 or rec.size == 0 or (series and rec.shape != series[0].shape):
            raise ValueError(
                f"{bad}: line {number} is not a recording of the first one's shape (comma-separated numbers "
                "per dimension, ':' between dimensions, then ':label')"
            )
        if label not in classes:
            raise ValueError(f"{bad}: line {number} has label {label!r}, not one of @classLabel {list(classes)}")
        series.append(rec)
        labels.append(label)
    if not series:
        raise ValueError(f"{bad}: it has {'no recordings after @data' if in_data else 'no @data line'}")
    return series, labels, classes


def load_basic_motions(directory: str | os.PathLike | None = None) -> MotionRecordings:
    """Read BasicMotions' TRAIN and TEST files (all 80 recordings, TRAIN first) from the data directory."""
    series: list[np.ndarray] = []
    labels: list[str] = []
    classes: tuple[str, ...] = ()
    for part in ("TRAIN", "TEST"):
        path = require(f"BasicMotions_{part}.ts", directory)
        s, lab, found = _read_ts(path)
        if series and (found != classes or s[0].shape != series[0].shape):
            raise ValueError(
                f"{path} holds recordings of shape {s[0].shape} with classes {list(found)}, but "
                f"BasicMotions_TRAIN.ts holds {series[0].shape} with {list(classes)}"
            )
        classes = found
        series += s
        labels += lab
    index = {c: i for i, c in enumerate(classes)}
    return MotionRecordings(np.stack(series), np.array([index[x] for x in labels]), classes)


@validate_params(n_clients=POSITIVE_INT, recordings_per_activity=POSITIVE_INT)
def motion_sessions(
    data: MotionRecordings | None = None,
    *,
    n_clients: int = 4,
    activities_per_client: int = 3,
    recordings_per_activity: int = 3,
    seed: int = 0,
) -> MotionSessions:
    """Sessions of ``n_clients`` wearers, each doing ``activities_per_client`` of the 4 activities.

    Client j draws its activities at random, then ``recordings_per_activity`` recordings of each
    (without replacement across clients while they last), and strings them in random order into
    one sequence. Channels are passed through ``arcsinh``, a fixed transform (no client's
    statistics) that tames the running and badminton swings without losing their sign.
    """
    data = load_basic_motions() if data is None else data
    if not isinstance(data, MotionRecordings):
        raise TypeError(f"data must be MotionRecordings (load_basic_motions()) or None, got {type(data).__name__}")
    n_classes = len(data.class_names)
    if not 1 <= activities_per_client <= n_classes:
        raise ValueError(f"activities_per_client must lie in 1..{n_classes}, got {activities_per_client}")
    rng = np.random.default_rng(seed)
    pools = {c: list(rng.permutation(np.flatnonzero(data.labels == c))) for c in range(n_classes)}
    sequences, activities, recordings = [], [], []
    for _ in range(n_clients):
        chosen = rng.choice(n_classes, activities_per_client, replace=False)
        picks = []
        for c in chosen:
            for _ in range(recordings_per_activity):
                if not pools[c]:
                    pools[c] = list(rng.permutation(np.flatnonzero(data.labels == c)))
                picks.append(pools[c].pop())
        shuffled = rng.permutation(picks)
        sequences.append(np.arcsinh(np.concatenate([data.series[i] for i in shuffled])))
        activities.append(np.concatenate([np.full(data.series.shape[1], data.labels[i]) for i in shuffled]))
        recordings.append(np.asarray(shuffled))
    return MotionSessions(sequences, activities, recordings, data.class_names)
