"""``bayesfuse summarize MODEL --data DATA``: a client's summary of its own data, beside its model file.

The client reads its model file as ``bayesfuse fuse`` and :func:`bayesfuse.load` do (a safe
state_dict of a network bayesfuse recognises: MLP, ``make_cnn`` ConvNet, LSTMClassifier,
HorseshoeBNN), and
its data from a local ``.npz`` file holding ``x`` (inputs, one row per example; images are
flattened) and ``y`` (integer labels). :func:`bayesfuse.summarize` makes one pass over it and
the summary is written, atomically, beside the model (``model.pt`` ->
``model.summary.safetensors``), where ``bayesfuse fuse`` looks for it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from bayesfuse._io import check_writable, recover
from bayesfuse._text import first_line
from bayesfuse.checkpoints import Checkpoint, read_checkpoint
from bayesfuse.loading import finish_interrupted_write, load_read
from bayesfuse.summaries import check_precisions, save_summary, summarize, summary_path

__all__ = ["summarize_file", "read_client_data"]


def read_client_data(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (float32, one flat row per example) and ``y`` (int64) of a client's ``.npz`` data file.

    Refuses, in one line naming what is missing, a missing file, one that is not ``.npz``, or one
    without the arrays ``x`` and ``y`` (of one example each per row, integer labels).
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"data {path} is a directory; give the client's .npz file")
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist (a .npz with arrays x and y)")
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a .npy: one array, no labels
            raise ValueError(f"it holds one array of shape {np.shape(loaded)}, not the arrays x and y")
        with loaded as data:
            arrays = {k: data[k] for k in data.files}
    except (ValueError, OSError, EOFError) as err:
        if isinstance(err, PermissionError):
            raise PermissionError(f"data file {path}: permission denied") from None
        why = "" if "allow_pickle" in str(err) else f" ({err})"  # numpy's guess that text is pickled misleads
        raise ValueError(
            f"data file {path} is not a NumPy .npz archive{why}: save the inputs as x and the labels as y with "
            "numpy.savez(path, x=inputs, y=labels)"
        ) from None
    if not isinstance(arrays, dict):
        raise ValueError(f"data file {path} holds one array, not a .npz archive with x and y")
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise ValueError(
            f"data file {path} has no array {' and no array '.join(repr(k) for k in missing)} (it holds "
            f"{', '.join(repr(k) for k in arrays) or 'nothing'}); save the inputs as x and the labels as "
            "y: numpy.savez(path, x=inputs, y=labels)"
        )
    x, y = arrays["x"], arrays["y"]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"data file {path}: y must be a 1-D array of integer labels, got {y.dtype} of shape {y.shape}")
    if x.ndim < 2 or len(x) != len(y) or not (np.issubdtype(x.dtype, np.number) and not np.iscomplexobj(x)):
        raise ValueError(
            f"data file {path}: x must hold one row of real inputs per label ({len(y)} labels), got "
            f"{x.dtype} of shape {x.shape}"
        )
    if len(y) == 0:
        raise ValueError(f"data file {path}: it holds no examples (x and y are empty)")
    x = x.reshape(len(x), -1)  # integers (token ids, pixels) as int64: summarize reads them as the network does
    x = x.astype(np.int64) if np.issubdtype(x.dtype, np.integer) else x.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"data file {path}: x has NaN or infinite values")
    return x, y.astype(np.int64)


def summarize_file(
    model_path: str | os.PathLike,
    data_path: str | os.PathLike,
    *,
    out: str | os.PathLike | None = None,
    prior_precision: float = 1.0,
    force: bool = False,
    precisions: str = "bfloat16",
    like=None,
) -> dict:
    """Summarise the model in ``model_path`` on the client's data ``data_path``; write the summary.

    Parameters
    ----------
    model_path : path
        The client's trained model (``.pt``/``.pth``/``.safetensors`` state_dict).
    data_path : path
        Its training data (:func:`read_client_data`).
    out : path, optional
        Where to write (a ``.safetensors`` name); :func:`~bayesfuse.summaries.summary_path` of the
        model by default, where ``bayesfuse fuse`` reads it.
    prior_precision : float
        ``delta`` of the Laplace approximation (:func:`bayesfuse.summarize`).
    force : bool
        Replace an existing summary file.
    precisions : {"bfloat16", "float32"}
        The weights' precisions, the output Gram and its eigenvalues in bfloat16 (a version 6
        summary) or float32 (version 4) (:func:`bayesfuse.summarize`).
    like : nn.Module, optional
        The client's network (any widths; ``--model`` on the command line), for a file whose
        entry names bayesfuse cannot read (:func:`bayesfuse.load`'s ``like``): traced and run on
        the client's own inputs.

    Returns
    -------
    dict
        ``path``, ``bytes`` (of the summary file), ``model_bytes`` (of the model's tensors: not
        an optimizer's state in the same checkpoint), ``state_dict_key`` (the entry of a
        checkpoint dict the model was read from, None for a plain state_dict), ``n_examples``
        and ``seconds`` (all of it: reading, the pass, writing).
    """
    start = time.perf_counter()
    model_path = Path(model_path)
    out = summary_path(model_path) if out is None else Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"a summary is a .safetensors file, got {out.name!r}")
    if out.resolve() == model_path.resolve():
        raise ValueError(f"the summary {out} would replace the model file")
    check_writable(out.parent)
    recover([out])
    if out.is_dir():
        raise IsADirectoryError(f"{out} is a directory; give a file name for the summary")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; replace it with force=True")
    if not (isinstance(prior_precision, (int, float)) and np.isfinite(prior_precision) and prior_precision > 0):
        raise ValueError(f"prior_precision must be a positive number, got {prior_precision!r}")
    check_precisions(precisions)
    x, y = read_client_data(data_path)
    finish_interrupted_write(model_path)  # as bayesfuse.load does before it reads
    checkpoint = read_checkpoint(model_path)  # once: the network and its state_dict_key
    model = _client_model(checkpoint, model_path, x, like, data_path)
    try:
        summary = summarize(model, x, y, prior_precision=prior_precision, precisions=precisions)
    except RuntimeError as err:  # torch, past the first batch summarize runs
        raise ValueError(
            f"{model_path}: the network cannot run on the inputs x of shape {x.shape} of {data_path} "
            f"({first_line(err)})"
        ) from None
    except ValueError as err:  # the labels (or inputs) of the data file do not fit the network
        if str(data_path) in str(err):
            raise
        raise ValueError(f"{model_path} on data file {data_path}: {err}") from None
    save_summary(summary, out, overwrite=force)
    return {
        "path": str(out),
        "bytes": out.stat().st_size,
        "model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "state_dict_key": checkpoint.state_dict_key,
        "n_examples": summary.n_examples,
        "seconds": time.perf_counter() - start,
    }


def _client_model(
    checkpoint: Checkpoint, path: Path, x: np.ndarray, like=None, data_path: str | os.PathLike | None = None
):
    """The network in ``path`` (read as ``checkpoint``), as :func:`bayesfuse.load` rebuilds it
    (without any fused posterior); into ``like`` when given, traced and run on the first rows of
    ``x`` (of ``data_path``)."""
    from bayesfuse.nets.state import model_input

    if like is not None:
        try:
            model = load_read(checkpoint, path, like=like, posterior=False, example_input=model_input(x[:2], like))
        except ValueError as err:  # the data file's inputs do not fit the network, most often
            raise ValueError(f"{path} on data file {data_path}: {err}") from None
        return _a_clients(model, path)
    try:
        model = load_read(checkpoint, path, n_features=int(np.prod(x.shape[1:])), posterior=False)
    except ValueError as err:
        message = str(err)
        if "like=model" not in message:
            raise
        raise ValueError(
            message.split("; give")[0] + "; give your network with --model MODULE:NAME, or summarise it in "
            "Python: bayesfuse.summarize(model, x, y), then bayesfuse.summaries.save_summary(summary, "
            "summary_path(MODEL))"
        ) from None
    return _a_clients(model, path)


def _a_clients(model, path: Path):
    """``model``, refused when it is a fused BNN with client heads rather than a client's network."""
    from bayesfuse.models.bnn import HorseshoeBNN
    from bayesfuse.models.bnn_sites import has_heads, is_bnn_state

    state = model.state_dict()
    if has_heads(state) or (is_bnn_state(state) and not isinstance(model, HorseshoeBNN)):
        raise ValueError(
            f"{path} is a fused BNN with client heads, not a client's network: summarise the clients' own BNNs"
        )
    return model
