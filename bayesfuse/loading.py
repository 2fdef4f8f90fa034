"""``bayesfuse.load(path)``: a fused checkpoint back as a module, ready to predict.

``bayesfuse fuse`` writes a state_dict (``.pt`` or ``.safetensors``) and a JSON report beside
it. :func:`load` reads the file safely (``torch.load(weights_only=True)`` or safetensors) and
re-creates the network at the fused widths:

* :class:`~bayesfuse.nets.mlp.MLP` (``layers.{i}.weight``), the ConvNets of
  :func:`~bayesfuse.nets.arch.make_cnn` (their input channels and image size read off the
  weights, see ``n_features``), :class:`~bayesfuse.nets.arch.LSTMClassifier` and
  :class:`~bayesfuse.models.bnn.HorseshoeBNN` (its state_dict *is* its posterior: means and
  log-scales of every site, so a fused BNN loads with its uncertainty);
* any other network given as a template, ``like=model``: the template's layers are re-created
  at the file's widths (:func:`~bayesfuse.nets.arch.rebuild`), which also gives position-aware
  layers the encodings of their new widths.

A model fused with client summaries has its output layer's posterior beside it
(``fused.pt.posterior.safetensors``, :func:`~bayesfuse.checkpoints.posterior_path`): :func:`load`
then returns a :class:`~bayesfuse.nets.laplace.LastLayerLaplace`, the network at its posterior
mean with the Gaussian posterior of its output layer (``posterior=False``: the network alone).
A model fused keeping the clients' own output layers (``bayesfuse fuse --head clients``) has
them beside it (``fused.pt.heads.safetensors``, :func:`~bayesfuse.checkpoints.heads_path`):
:func:`load` then returns a :class:`~bayesfuse.nets.heads.ClientHeads` that predicts with them.
A fusion made in Python and written by :func:`bayesfuse.save` has the same
files, its heads and posterior as the saved module's own tensors: it loads predicting exactly as
it did.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path

from torch import nn

from bayesfuse._io import _journal_path, recover
from bayesfuse._text import warn_from_caller
from bayesfuse.checkpoints import (
    Checkpoint,
    HashedState,
    heads_path,
    posterior_path,
    read_checkpoint,
    read_heads,
    read_posterior,
    reported_input,
    tensors_sha256,
)
from bayesfuse.fusion_record import fusion_files, fusion_path
from bayesfuse.nets.user_module import FILE_MODULE_PREFIX

__all__ = ["in_file_dtype", "load", "load_read", "load_report", "recognised"]


def load_report(path: str | os.PathLike, model_tensors: dict | None = None, *, strict: bool = True) -> dict | None:
    """The JSON report ``bayesfuse fuse`` wrote beside ``path`` (``path + '.json'``), or None.

    A file there that is no bayesfuse report (not JSON, or JSON without ``versions.bayesfuse``:
    a user's own notes beside a checkpoint) is left alone with a warning, and None returned.
    Given the model file's tensors, a report written for other tensors (its
    ``model_tensors_sha256``, :func:`~bayesfuse.checkpoints.tensors_sha256`) is refused
    (``strict=False``: warned about, and None returned).
    """
    report = Path(path).with_name(Path(path).name + ".json")
    if not report.is_file():
        return None
    try:
        record = json.loads(report.read_text(encoding="utf-8"))
        ours = (
            isinstance(record, dict) and isinstance(record.get("versions"), dict) and "bayesfuse" in record["versions"]
        )
        why = "" if ours else "it names no bayesfuse version"
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        why = f"not JSON: {err}"
    if why:
        warnings.warn(f"{report}: not a bayesfuse fusion report ({why}); ignored", UserWarning, stacklevel=3)
        return None
    written_for = record.get("model_tensors_sha256")
    if model_tensors is not None and written_for is not None and written_for != tensors_sha256(model_tensors):
        message = f"{report}: this report was written for other tensors than {path}'s"
        if strict:
            raise ValueError(f"{message}; fuse again, or remove the stale report (posterior=False loads the network)")
        warnings.warn(f"{message}; ignored", UserWarning, stacklevel=3)
        return None
    return record


def load(
    path: str | os.PathLike,
    *,
    like: nn.Module | None = None,
    n_features: int | None = None,
    posterior: bool = True,
    example_input=None,
) -> nn.Module:
    """The network stored in a (fused) checkpoint file, in eval mode.

    Parameters
    ----------
    path : path
        A ``.pt``/``.pth`` or ``.safetensors`` state_dict, e.g. the output of ``bayesfuse fuse``.
    like : nn.Module, optional
        A network of the same architecture (any widths): the template for networks bayesfuse
        cannot recognise from their entry names, or with position-aware layers (which hold no
        entries of their own). A file fused with ``bayesfuse fuse --model MODULE:NAME`` loads
        without it when ``MODULE`` is imported already (nothing is imported because a file says
        so). The file's entries are checked against its traced spec
        (:func:`~bayesfuse.nets.tracing.spec_from_module`), the numbers its modules hold as
        widths set to the file's, and the rebuilt network is run once on an example input before
        it is returned: ``example_input``, else the input the file's report records (``bayesfuse
        fuse --input-shape``, or ``fuse``'s ``example_input`` for :func:`bayesfuse.save`), else
        one made from its first layer (:func:`~bayesfuse.nets.graph_spec.example_input_for`);
        where none can be had, it is returned unrun, with a warning.
    n_features : int, optional
        Input size of a ConvNet from :func:`~bayesfuse.nets.arch.make_cnn` (channels x side x
        side). By default the input channels are the first convolution's and the side is the
        one every 2x2 pooling halves exactly: the first dense layer's input side times 2 per
        pooling (8x8 digits through two poolings: 2x2 -> 8, n_features=64). Sides the poolings
        round down give the same weights (28x28 through three poolings ends at 3x3, as 24x24
        does): give n_features for those (784).
    example_input : Tensor, optional
        A batch of inputs to trace and run the template network on (``like``, or the one the
        report names), where its first layer does not tell the input's shape (a convolution, a
        recurrent layer, a dense layer applied to steps). Without one, the input is made from the
        first layer (:func:`~bayesfuse.nets.graph_spec.example_input_for`); if the template
        itself does not run on that, the error asks for one.
    posterior : bool
        Whether to read what ``bayesfuse fuse`` wrote beside the file when there is any: the
        clients' own heads (``--head clients``), the output layer's posterior (written when it
        used client summaries) and the matched layers' posteriors.

    Returns
    -------
    nn.Module
        With ``fusion_report``: the JSON report beside the file (None when there is none), and
        ``fusion``: the matched layers' posteriors recorded beside the file
        (``fused.pt.fusion.safetensors``, :mod:`bayesfuse.fusion_record`) as a
        :class:`~bayesfuse.fusion.FusionResult`, so that ``bayesfuse.to_arviz(model.fusion)``
        works as on a fresh result (None when there is none). A
        :class:`~bayesfuse.nets.heads.ClientHeads` when the clients' heads are beside the file,
        else a :class:`~bayesfuse.nets.laplace.LastLayerLaplace` when the output layer's
        posterior is.

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        The file is not a state_dict, or its entries fit none of the known architectures and no
        ``like`` was given, or a ConvNet's ``n_features`` does not fit its weights; or the
        posterior beside it is unreadable, of another version or written for other tensors.
    """
    finish_interrupted_write(path)
    return load_read(
        read_checkpoint(path), path, like=like, n_features=n_features, posterior=posterior, example_input=example_input
    )


def load_read(
    checkpoint: Checkpoint,
    path: str | os.PathLike,
    *,
    like: nn.Module | None = None,
    n_features: int | None = None,
    posterior: bool = True,
    example_input=None,
) -> nn.Module:
    """:func:`load` of the file ``path`` whose tensors were read already (``checkpoint``, by
    :func:`~bayesfuse.checkpoints.read_checkpoint`): for a caller that needs the checkpoint too
    (its ``state_dict_key``), so that the file is read once."""
    state = HashedState(checkpoint.tensors)  # the report and each side file check its digest: once
    name = str(path)
    report = load_report(path, state, strict=posterior)
    said = (report or {}).get("load")
    saved: dict = said if isinstance(said, dict) else {}
    if like is None and saved.get("like"):  # bayesfuse.save found the entries alone do not give the network back
        cls = str(saved["like"]).rpartition(":")[2]
        raise ValueError(
            f"{name} was saved from a network {saved['like']} that its entries alone do not give back "
            f"({saved.get('why')}): load it with like= a network built as the saved one was, e.g. "
            f"bayesfuse.load({str(path)!r}, like={cls.rpartition('.')[2]}(...))"
        )
    if n_features is None and isinstance(saved.get("n_features"), int):
        n_features = saved["n_features"]  # the input size the saved network ran on

    def given_input():
        """``example_input``, else what ``bayesfuse fuse --model`` traced and ran the network on
        (``--input-shape``): read only where a network is given or named, which a file load
        recognises never needs."""
        return example_input if example_input is not None else reported_input(report, name)

    if like is not None:
        model = _like(like, state, name, given_input())
    else:
        try:
            with warnings.catch_warnings():
                if saved and not saved.get("like"):  # bayesfuse.save checked that it computes the saved function
                    warnings.simplefilter("ignore")
                model = recognised(state, name, n_features)
        except ValueError:
            network = _reported_network(report, path)
            if not network:
                raise
            template = _imported_network(network)
            if template is None:
                module, _, cls = network.partition(":")
                from_file = module.startswith(FILE_MODULE_PREFIX)  # --model FILE.py:NAME
                shown = f"{module.removeprefix(FILE_MODULE_PREFIX)}.py:{cls}" if from_file else network
                raise ValueError(
                    f"{name} was fused from your network {shown}: "
                    + (
                        f"import {cls} from that file and load with like="
                        if from_file
                        else "import it, or load with like="
                    )
                    + f", e.g. bayesfuse.load({str(path)!r}, like={cls.rpartition('.')[2]}())"
                ) from None
            model = _like(template, state, name, given_input())
        else:
            if example_input is not None:  # given, it is checked: the network must run on it
                _runs_on(model, example_input, name)
    model = in_file_dtype(model, state)
    if posterior:
        _check_side_files(path, report)
    if posterior and heads_path(path).is_file():
        model = _with_heads(model, heads_path(path), state, name)
    elif posterior and posterior_path(path).is_file():
        model = _with_posterior(model, posterior_path(path), state, name)
    # plain attributes: torch's stub types a module's attributes as Tensor | Module
    model.fusion_report = report  # type: ignore[assignment]
    model.fusion = None  # type: ignore[assignment]
    if posterior and fusion_path(path).is_file():
        from bayesfuse.fusion_record import read_fusion

        model.fusion = read_fusion(fusion_path(path), model, state, name)
    return model.eval()


def in_file_dtype(model: nn.Module, state: dict) -> nn.Module:
    """``model`` in the dtype of the file's floating-point tensors where they have one, wider than
    the one the network was built in (a float64 fusion in a float32 session), its entries read
    again at their precision. A narrower one (bfloat16, float16) is read into the network's
    dtype as it is, exactly, and runs on the inputs it ran on."""
    import torch

    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    built = {t.dtype for t in model.state_dict().values() if t.is_floating_point()}
    if len(dtypes) != 1 or not built or all(torch.finfo(d).bits >= torch.finfo(next(iter(dtypes))).bits for d in built):
        return model
    model = model.to(dtypes.pop())
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if key in state and state[key].shape == t.shape and t.is_floating_point():
                t.copy_(state[key])
    return model


def _runs_on(model: nn.Module, example_input, name: str) -> None:
    """Refuse, naming the file, an ``example_input`` that the network loaded from it does not run on."""
    from bayesfuse.nets.graph_spec import check_example_runs

    try:
        check_example_runs(model, example_input)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def _check_side_files(path: str | os.PathLike, report: dict | None) -> None:
    """Refuse a model whose report names files beside it that are gone: without them it would
    predict otherwise (the network alone instead of the clients' heads) without a word."""
    for key, side, what in (
        ("heads", heads_path(path), "the clients' heads"),
        ("posterior", posterior_path(path), "the output layer's posterior"),
        ("fusion_record", fusion_path(path), "the matched layers' posteriors"),
    ):
        if isinstance((report or {}).get(key), dict) and not side.is_file():
            raise ValueError(
                f"{path}: its report names {what} beside it, {side.name}, which is not there: copy it "
                "beside the model, or load the network alone with posterior=False"
            )


def finish_interrupted_write(path: str | os.PathLike) -> None:
    """Finish or undo a fusion's write that a kill interrupted (:func:`bayesfuse._io.recover`), so
    that the model and the files beside it are read all from one fusion; waits for a writer that
    is still at it."""
    if not _journal_path(Path(path)).exists():  # no commit of this model was interrupted
        return
    try:
        recover(fusion_files(path))
    except (OSError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"{path}: a write of this model was interrupted and cannot be finished here ({err}); write it again"
        ) from None


def _reported_network(report: dict | None, path) -> str | None:
    """The ``"module:Class"`` the report names (``architecture.network``), or None; a report whose
    fields are not what ``bayesfuse fuse`` writes is refused in one line."""
    architecture = (report or {}).get("architecture")
    network = architecture.get("network") if isinstance(architecture, dict) else None
    if (architecture is not None and not isinstance(architecture, dict)) or not isinstance(network, (str, type(None))):
        raise ValueError(f"{path}.json: its architecture is not what bayesfuse fuse writes; remove or fix it")
    return network


def _imported_network(network: str) -> nn.Module | None:
    """The network ``"module:Class"`` the report names, built with no arguments, when its module is
    imported already and the name is an ``nn.Module`` class (a file names it, so nothing is
    imported, and nothing but a network's constructor called, on its say); None otherwise."""
    import sys

    module_name, _, qualname = network.partition(":")
    module = sys.modules.get(module_name)
    factory = module
    for part in qualname.split("."):
        factory = getattr(factory, part, None)
    if module is None or not (isinstance(factory, type) and issubclass(factory, nn.Module)):
        return None
    try:
        model = factory()
    except Exception:  # a class that needs arguments: the caller gives like=
        return None
    return model if isinstance(model, nn.Module) else None


def _like(like: nn.Module, state: dict, name: str, example_input=None) -> nn.Module:
    """``like`` rebuilt at the file's widths: checked against its traced spec, loaded, run once.

    A network with ``nn.MultiheadAttention`` is loaded split into heads (its file holds either
    form: :func:`~bayesfuse.nets.attention.split_state_dict`), then merged back where the heads'
    widths allow (:func:`~bayesfuse.nets.attention.merge_heads`); else it stays
    :class:`~bayesfuse.nets.attention.HeadAttention`, which computes the same function."""
    from bayesfuse.nets.attention import merged_where_possible, multihead_modules, split_heads, split_state_dict

    if not multihead_modules(like):
        return _like_traced(like, state, name, example_input)
    if any(k.endswith("in_proj_weight") for k in state):  # the nn.MultiheadAttention form
        try:
            state = split_state_dict(like, state)
        except ValueError as err:
            raise ValueError(f"{name}: its entries do not fit the template network ({err})") from None
    return merged_where_possible(_like_traced(split_heads(like), state, name, example_input), like)[0]


def _like_traced(like: nn.Module, state: dict, name: str, example_input=None) -> nn.Module:
    from bayesfuse.nets.arch import check_runs, rebuild
    from bayesfuse.nets.graph_spec import check_example_runs, example_input_for
    from bayesfuse.nets.tracing import UnsupportedLayerError, spec_from_module

    try:
        example_input_for(like, example_input)
    except ValueError:
        x = None  # no input to be had: the file's entries are all that is checked
    else:  # the template runs on it (else one line asking for example_input=): a failure below is the file's
        x = check_example_runs(like, example_input)
    try:
        spec = spec_from_module(like, x)
    except (UnsupportedLayerError, ValueError):
        spec = None  # a network no spec describes: loading and running it is the check
    try:
        if spec is not None:
            spec.check(state, name)
        model = rebuild(like, state, spec)
    except (RuntimeError, KeyError, ValueError) as err:
        raise ValueError(f"{name}: its entries do not fit the template network ({str(err).splitlines()[0]})") from None
    if x is not None:
        check_runs(model, x, what=f"{name} in {type(like).__name__}")
    else:
        warn_from_caller(
            f"{name} was loaded into {type(like).__name__} without running it, nor setting the widths its modules "
            "hold (self.hidden_dim): its first layer does not tell the input's shape and the file records none; "
            "give example_input= (a batch of your data)"
        )
    return model


def _with_heads(model: nn.Module, path: Path, state: dict, name: str) -> nn.Module:
    """``model`` predicting with the clients' own heads in ``path`` (:func:`~bayesfuse.checkpoints.read_heads`)."""
    from bayesfuse.nets.heads import ClientHeads

    heads, pool = read_heads(path, state, name)
    try:
        if "buffers" in heads:  # saved by bayesfuse.save: the module's own tensors
            return ClientHeads.from_buffers(
                model,
                heads["output"],
                heads["buffers"],
                pool=pool,
                pseudo_count=heads["pseudo_count"],
                predictive=heads["predictive"],
                form=heads["form"],
            )
        return ClientHeads.from_arrays(model, heads, pool=pool)
    except (AttributeError, ValueError) as err:
        raise ValueError(f"{path}: does not fit {name}'s output layer {heads['output']!r} ({err})") from None


def _with_posterior(model: nn.Module, path: Path, state: dict, name: str) -> nn.Module:
    """``model`` with the output layer's posterior in ``path`` (:func:`~bayesfuse.checkpoints.read_posterior`)."""
    from bayesfuse.nets.laplace import LastLayerLaplace

    output, precision, saved = read_posterior(path, state, name)
    try:
        if saved is not None:  # saved by bayesfuse.save: the module's own tensors
            return LastLayerLaplace.from_buffers(model, output, saved)
        weight, bias = (precision[f"{output}.{leaf}"] for leaf in ("weight", "bias"))
        return LastLayerLaplace(model, output, 1.0 / weight.astype("float64"), 1.0 / bias.astype("float64"))
    except (KeyError, ValueError) as err:
        raise ValueError(f"{path}: does not fit {name}'s output layer {output!r} ({err})") from None


def recognised(state: dict, name: str, n_features: int | None = None) -> nn.Module:
    """The known network whose entry names ``state`` has, built at its widths; a state_dict that
    has those names but not their shapes or companions is refused in one line naming the file."""
    try:
        return _recognised_network(state, name, n_features)
    except (KeyError, IndexError, ZeroDivisionError, RuntimeError, TypeError) as err:
        raise ValueError(
            f"{name}: its entries fit no network bayesfuse builds ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else err!r}); give a network of the same architecture as like=model"
        ) from None


def _recognised_network(state: dict, name: str, n_features: int | None) -> nn.Module:
    from bayesfuse.models.bnn import HorseshoeBNN
    from bayesfuse.models.bnn_sites import has_heads

    if HorseshoeBNN.is_state_dict(state) or has_heads(state):
        from bayesfuse.models.bnn_heads import bnn_from_state

        return bnn_from_state(state, name)
    keys = set(state)
    if any(re.fullmatch(r"layers\.\d+\.weight", k) for k in keys):
        from bayesfuse.nets.mlp import MLP

        return _strict(lambda: MLP.from_state_dict(state), name, "an MLP")
    if (
        keys
        and all(re.fullmatch(r"\d+\.(weight|bias)", k) for k in keys)
        and all(state[k].ndim == 2 for k in keys if k.endswith("weight"))
    ):
        return _linear_sequential(state, name)
    if "lstm.weight_ih_l0" in keys and "fc.weight" in keys:
        return _lstm(state, name)
    if any(k.startswith("network.") for k in keys) and ({"shares", "weight_var", "temperature"} & keys):
        kind = "ClientHeads" if "shares" in keys else "LastLayerLaplace"
        raise ValueError(
            f"{name} holds the state_dict of a {kind} (a fused network with its output posterior), which "
            "bayesfuse.load does not rebuild: save the fusion with bayesfuse.save(result, path), which writes the "
            "network and its posterior beside it as bayesfuse fuse does, and bayesfuse.load reads them back"
        )
    if any(t.ndim == 4 for t in state.values()):
        return _cnn(state, name, n_features)
    raise ValueError(
        f"{name}: its entry names fit no network bayesfuse builds (MLP, make_cnn ConvNet, "
        "LSTMClassifier, HorseshoeBNN); give a network of the same architecture as like=model, or "
        "load the tensors into your own network with bayesfuse.checkpoints.load_state_dict"
    )


def _strict(build, name: str, what: str) -> nn.Module:
    try:
        return build()
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"{name}: not {what} state_dict ({str(err).splitlines()[0]}); give like=model") from None


def _linear_sequential(state: dict, name: str) -> nn.Module:
    """An ``nn.Sequential`` of the file's Linear layers (``0.weight``, ``2.weight``, ...) with ReLU
    in each one-module gap between them: a state_dict holds no activations, so ReLU is assumed
    and said in a warning; other gaps are refused."""
    import warnings

    from torch import nn as tnn

    indices = sorted({int(k.partition(".")[0]) for k in state})
    gaps = [b - a for a, b in zip(indices, indices[1:])]
    if indices[0] != 0 or any(g != 2 for g in gaps):
        raise ValueError(
            f"{name}: an nn.Sequential of Linear layers at {indices}; its other modules are not in a "
            "state_dict, so give a network of the same architecture as like=model"
        )
    layers: list[tnn.Module] = []
    for i in indices:
        out_features, in_features = state[f"{i}.weight"].shape
        layers.append(tnn.Linear(in_features, out_features, bias=f"{i}.bias" in state))
        if i != indices[-1]:
            layers.append(tnn.ReLU())
    warnings.warn(
        f"{name}: a state_dict holds no activations; read as an nn.Sequential of Linear layers with ReLU "
        f"at {', '.join(str(i + 1) for i in indices[:-1])}: pass like=model if your network uses others",
        UserWarning,
        stacklevel=4,
    )
    return _strict(lambda: _loaded(tnn.Sequential(*layers), state), name, "an nn.Sequential")


def _loaded(model: nn.Module, state: dict) -> nn.Module:
    model.load_state_dict(state)
    return model


def _lstm(state: dict, name: str) -> nn.Module:
    from bayesfuse.nets.arch import LSTMClassifier

    layers = len([k for k in state if re.fullmatch(r"lstm\.weight_ih_l\d+", k)])
    hidden = state["lstm.weight_hh_l0"].shape[1]
    side = state["lstm.weight_ih_l0"].shape[1]

    def build():
        model = LSTMClassifier(side * side, state["fc.weight"].shape[0], hidden=hidden, num_layers=layers)
        model.load_state_dict(state)
        return model

    return _strict(build, name, "an LSTMClassifier")


def _cnn(state: dict, name: str, n_features: int | None) -> nn.Module:
    """A :func:`make_cnn` network with the file's input channels, channels and dense widths.

    The input channels are the first convolution's; the image side is read off the first dense
    layer's input width (``channels x s x s`` after the last pooling) and the number of 2x2
    poolings (one per convolution), unless ``n_features`` gives it.
    """
    from bayesfuse.nets.arch import make_cnn

    convs = [k for k, t in state.items() if t.ndim == 4]
    dense = [k for k, t in state.items() if t.ndim == 2]
    if not dense:
        raise ValueError(f"{name}: a ConvNet needs dense layers after its convolutions; give like=model")
    channels = [state[k].shape[0] for k in convs]
    in_channels = int(state[convs[0]].shape[1])
    sides = _image_sides(state[dense[0]].shape[1], channels[-1], len(convs), name)
    n_features = _cnn_input_size(n_features, in_channels, sides, name)
    hidden = [state[k].shape[0] for k in dense[:-1]]
    batchnorm = any(k.endswith("running_var") for k in state)

    def build():
        model = make_cnn(
            n_features,
            state[dense[-1]].shape[0],
            channels=channels,
            hidden=hidden,
            batchnorm=batchnorm,
            in_channels=in_channels,
        )
        model.load_state_dict(state)
        return model

    return _strict(build, name, "a make_cnn ConvNet")


def _image_sides(flat: int, channels: int, n_pools: int, name: str) -> range:
    """The image sides that ``n_pools`` 2x2 poolings (each rounding down) take to the side whose
    ``channels x side x side`` outputs the first dense layer reads (``flat`` inputs)."""
    side = math.isqrt(flat // channels)
    if channels * side * side != flat or side < 1:
        raise ValueError(
            f"{name}: its first dense layer reads {flat} inputs, not {channels} square feature maps of "
            "the last convolution, so it is no make_cnn ConvNet; give like=model"
        )
    return range(side * 2**n_pools, (side + 1) * 2**n_pools)


def _cnn_input_size(n_features: int | None, in_channels: int, sides: range, name: str) -> int:
    """``n_features`` checked against the weights, or by default the input whose side every pooling
    halves exactly (the smallest of ``sides``, which all give the same weights)."""
    if n_features is None:
        return in_channels * sides[0] ** 2
    side = math.isqrt(n_features // in_channels)
    if in_channels * side * side != n_features or side not in sides:
        low, high = (in_channels * s**2 for s in (sides[0], sides[-1]))
        raise ValueError(
            f"{name}: n_features={n_features} does not fit these weights ({in_channels}-channel square "
            f"images of {sides[0]} to {sides[-1]} pixels a side do, n_features={low} to {high})"
        )
    return n_features
