"""Command line: ``bayesfuse demo``, ``bayesfuse fuse``, ``bayesfuse summarize`` and ``bayesfuse methods``.

Exit status: 0 on success; 2 for every failure the user can cause or fix (bad options or inputs,
outputs that exist, unreadable files, a read-only or full output directory, a file-size limit,
not enough memory), reported as one line ``bayesfuse CMD: error: ...`` on stderr with nothing
written, argparse's usage errors included; 130 when interrupted (Ctrl-C). Anything else is a
bug and keeps its traceback.

``bayesfuse fuse`` checks its method, hyper-parameters and output name before torch is
imported, so a mistyped argument is answered at once (:func:`_checked_fuse`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import os
import re
import sys
import textwrap
import warnings
from typing import Literal, NoReturn, Sequence, cast

from bayesfuse._text import plain_line

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, ``PROG: error: ...; see PROG --help``
    (argparse's own prints the whole usage first); its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {plain_line(message)}; see {self.prog} --help\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 100 or 200,100, got {text!r}"
        ) from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"hidden widths must be positive, got {text!r}")
    return widths


def _methods(text: str) -> tuple[str, ...]:
    from bayesfuse.demo import DEMO_METHODS

    methods = tuple(m.strip().lower() for m in text.split(",") if m.strip())
    unknown = [m for m in methods if m not in DEMO_METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown methods {unknown}; choose from {', '.join(DEMO_METHODS)}")
    return methods


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _pan(text: str):
    from bayesfuse.nets.pans import PANConfig

    parts = [p.strip() for p in text.split(",")]
    try:
        mode, period, amplitude = parts[0], float(parts[1]), float(parts[2])
        if len(parts) != 3:
            raise IndexError
        return PANConfig(cast(Literal["add", "mul"], mode), period, amplitude)  # PANConfig checks it
    except (IndexError, ValueError) as err:
        detail = f" ({err})" if isinstance(err, ValueError) and "float" not in str(err) else ""
        raise argparse.ArgumentTypeError(f"expected MODE,T,A such as mul,1,0.1, got {text!r}{detail}") from None


#: Exit statuses of ``bayesfuse`` (shown by ``--help``).
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_STATUS = (
    f"exit status: 0 done; {EXIT_ERROR} bad options or inputs, or a file error (unreadable input, "
    "existing or unwritable output, full disk, file-size limit, not enough memory): one line on "
    f"stderr, nothing written; {EXIT_INTERRUPTED} interrupted (Ctrl-C)."
)

#: What ``bayesfuse fuse --help`` shows after its options.
FUSE_EXAMPLES = """\
examples:
  bayesfuse fuse site_a.pt site_b.pt site_c.safetensors --method nafi --out f.pt
  bayesfuse fuse a.pt b.pt --method PFNM --hyper noise_var=1 n_iter=20 \\
      --class-counts counts.json --out fused.safetensors
  bayesfuse methods pfnm --kind network    # pfnm's keys for networks, defaults"""


def _fuse_help_epilog() -> str:
    return FUSE_EXAMPLES + "\n\n" + textwrap.fill(EXIT_STATUS, 78)


def _method_choices() -> str:
    """The methods ``bayesfuse fuse`` takes, by kind of input (those that need data are not among them)."""
    from bayesfuse import methods

    return (
        f"{', '.join(methods.names('network', needs_data=False))} (networks); "
        f"{', '.join(methods.names('bnn', needs_data=False))} (BNNs); any case"
    )


def build_parser() -> argparse.ArgumentParser:
    from bayesfuse import __version__

    parser = _Parser(prog="bayesfuse", description="Bayesian model fusion toolkit.", epilog=EXIT_STATUS)
    parser.add_argument("--version", action="version", version=f"bayesfuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from bayesfuse import methods

    demo = sub.add_parser(
        "demo",
        help="simulate a federation, train local MLPs, compare fusion methods",
        description="Split a dataset across clients (Dirichlet heterogeneity), train one MLP per "
        "client, build global models and print a table; write it as CSV/JSON plus a figure.",
    )
    demo.add_argument(
        "--dataset",
        default="digits",
        choices=["digits", "fashion-mnist", "mnist"],
        help="digits ships with scikit-learn; fashion-mnist needs `make data` (default: digits)",
    )
    demo.add_argument(
        "--data-path", default=None, help="directory of IDX files (or mnist .npz) for fashion-mnist / mnist"
    )
    demo.add_argument("--clients", "-J", type=_positive_int, default=10, help="number of clients (default: 10)")
    demo.add_argument(
        "--alpha",
        type=float,
        default=0.5,
        help="Dirichlet concentration of the class split; small is heterogeneous (default: 0.5)",
    )
    seeds = demo.add_mutually_exclusive_group()
    seeds.add_argument(
        "--seed", type=_non_negative_int, default=0, help="seed of split, initialisation and training (default: 0)"
    )
    seeds.add_argument(
        "--seeds",
        type=_non_negative_int,
        nargs="+",
        default=None,
        metavar="SEED",
        help="run once per seed and report mean +- sd over them, e.g. --seeds 0 1 2",
    )
    demo.add_argument(
        "--hidden", type=_widths, default=(100,), help="hidden widths, e.g. 100 or 200,100 (default: 100)"
    )
    demo.add_argument("--epochs", type=_positive_int, default=10, help="local training epochs (default: 10)")
    demo.add_argument(
        "--shared-init",
        action="store_true",
        help="all clients start from one initial network (as FedAvg assumes); "
        "default: each client draws its own, as separately trained models do",
    )
    demo.add_argument(
        "--holdout",
        type=float,
        default=0.1,
        help="share of each client's examples it keeps back from training to score the temperature "
        "round's candidates on (default: 0.1; 0: it scores them on its training examples)",
    )
    demo.add_argument(
        "--arch",
        default="mlp",
        choices=["mlp", "cnn", "lstm", "resnet20", "resnet18", "vit"],
        help="local networks: MLP (--hidden), ConvNet (--channels, then --hidden dense layers), "
        "LSTM over image rows (first --hidden width), ResNet-20 / ResNet-18 or a small vision "
        "transformer (--width) (default: mlp)",
    )
    demo.add_argument(
        "--channels",
        type=_widths,
        default=(16, 32),
        help="cnn: channels of the conv-BN-ReLU-maxpool blocks (default: 16,32)",
    )
    demo.add_argument(
        "--width",
        type=_positive_float,
        default=1.0,
        help="resnet20, resnet18: width multiplier of every stage's channels; vit: of the stream, "
        "heads and MLP (default: 1)",
    )
    demo.add_argument(
        "--methods",
        type=_methods,
        default=methods.names("network", featured=True),
        help="comma-separated methods after local/ensemble/fedavg, from "
        + ", ".join(methods.names("network", baseline=False, aliases=True))
        + ", fedavg-rounds (FedAvg with as many rounds as FedMA) (default: "
        + ",".join(methods.names("network", featured=True))
        + ")",
    )
    demo.add_argument(
        "--retrain-epochs",
        type=_positive_int,
        default=None,
        help="epochs of client training per FedMA/FedAvg round (default: --epochs)",
    )
    demo.add_argument(
        "--pan",
        type=_pan,
        default=None,
        metavar="MODE,T,A",
        help="position-aware neurons in the hidden layers, e.g. mul,1,0.1 (mode add or mul, "
        "period T, amplitude A); default: plain neurons",
    )
    demo.add_argument("--out", default="bayesfuse-demo", help="output directory (default: ./bayesfuse-demo)")
    demo.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing the demo's files")
    demo.add_argument(
        "--hyper",
        nargs="*",
        default=[],
        metavar="[METHOD.]KEY=VALUE",
        help="hyper-parameters of the fusion methods, as in `bayesfuse fuse`: KEY=VALUE for every "
        "method run that has KEY, METHOD.KEY=VALUE for one (e.g. noise_var=1 nafi.kl_weight=0.1)",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bars")

    fz = sub.add_parser(
        "fuse",
        help="fuse model files (state_dicts) into one",
        usage="%(prog)s MODEL MODEL [MODEL ...] --method NAME --out FILE [options]",
        description="Fuse the state_dicts of MLPs, ConvNets, LSTMs or HorseshoeBNNs (.pt, .pth or\n"
        ".safetensors, any order) into FILE, with a report of every setting in FILE.json.",
        epilog=_fuse_help_epilog(),
        formatter_class=functools.partial(argparse.RawDescriptionHelpFormatter, max_help_position=29),
    )
    fz.add_argument("models", nargs="+", metavar="MODEL", help="two or more model files")
    fz.add_argument("--method", required=True, metavar="NAME", help=_method_choices())
    fz.add_argument(
        "--hyper", nargs="*", default=[], metavar="KEY=VALUE", help="the method's keys (bayesfuse methods NAME)"
    )
    fz.add_argument("--out", required=True, metavar="FILE", help="fused model file (.pt, .pth or .safetensors)")
    fz.add_argument("--force", action="store_true", help="replace existing output files")
    fz.add_argument("--seed", type=_non_negative_int, default=0, metavar="N", help="seed of the matching (default: 0)")
    fz.add_argument(
        "--class-counts", default=None, metavar="FILE", help='JSON {"a.pt": [120, 0, 35]}: examples per class'
    )
    fz.add_argument(
        "--summaries",
        choices=["auto", "none"],
        default="auto",
        metavar="MODE",
        help="auto: use the client summaries; none: data-free",
    )
    fz.add_argument(
        "--head",
        choices=["auto", "shared", "clients"],
        default="auto",
        metavar="HEAD",
        help="auto, shared or clients (own output layers)",
    )
    fz.add_argument(
        "--pool",
        choices=["linear", "log"],
        default=None,
        metavar="POOL",
        help="the clients' heads pooled: linear or log",
    )
    fz.add_argument(
        "--pseudo-count",
        type=float,
        default=None,
        metavar="C",
        help="smoothing of the client heads (default: 1; 0: none)",
    )
    fz.add_argument(
        "--format",
        choices=["pt", "safetensors"],
        default=None,
        metavar="FMT",
        help="pt or safetensors (default: from --out's suffix)",
    )
    fz.add_argument(
        "--model",
        default=None,
        metavar="REF",
        help="your network, MODULE:NAME or FILE.py:NAME (literal arguments in parentheses if any): traced, the "
        "fused model run in it",
    )
    fz.add_argument(
        "--input-shape",
        default=None,
        type=_input_shape,
        metavar="D,...",
        help="--model's input shape without batch: 1,28,28",
    )
    fz.add_argument(
        "--arch",
        default="auto",
        choices=["auto", "mlp", "cnn", "lstm"],
        metavar="ARCH",
        help="layers: auto (default), mlp/cnn (a chain), lstm",
    )
    fz.add_argument(
        "--arch-spec", default=None, metavar="FILE", help="JSON permutation spec (bayesfuse.inference.spec)"
    )
    fz.add_argument(
        "--device", default=None, metavar="DEVICE", help="pfnm/nafi's matching with torch on cpu, cuda, mps"
    )
    fz.add_argument(
        "--dtype",
        default="float64",
        choices=["float32", "float64"],
        metavar="DTYPE",
        help="with --device: float64 (default) or float32",
    )

    ms = sub.add_parser(
        "methods",
        help="the fusion methods, or one method's hyper-parameters and their defaults",
        description="Without NAME: the fusion methods. With NAME: its hyper-parameters (bayesfuse "
        "fuse --hyper KEY=VALUE, or keyword arguments of bayesfuse.fuse), their defaults for each kind of "
        "input, constraints and meaning.",
        epilog=EXIT_STATUS,
    )
    ms.add_argument("name", nargs="?", default=None, metavar="NAME", help="a method, in any case")
    ms.add_argument(
        "--kind",
        choices=methods.KINDS,
        default=None,
        help="only the keys for one kind of input: network (point-estimate networks) or bnn (HorseshoeBNNs)",
    )

    sm = sub.add_parser(
        "summarize",
        help="a client's summary of its own data, beside its model file (for bayesfuse fuse)",
        description="One pass over the client's data: the Laplace precision of every weight (GGN diagonal), "
        "per-unit moments and class counts, written as MODEL's summary (model.pt -> model.summary.safetensors), "
        "where `bayesfuse fuse` reads it. Aggregates only: no example can be read back from it.",
        epilog=EXIT_STATUS,
    )
    sm.add_argument(
        "model",
        metavar="MODEL",
        help="the client's model file (.pt, .pth or .safetensors state_dict of "
        "an MLP, make_cnn ConvNet or LSTMClassifier)",
    )
    sm.add_argument(
        "--model",
        default=None,
        metavar="REF",
        dest="network",
        help="your network, MODULE:NAME or FILE.py:NAME (literal arguments in parentheses if any), for a file whose "
        "entry names bayesfuse "
        "cannot read: traced and run on the client's inputs",
    )
    sm.add_argument(
        "--data",
        required=True,
        metavar="DATA",
        help="the client's training data: a .npz file with arrays x (inputs) and y (integer labels)",
    )
    sm.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help="summary file (.safetensors; default: MODEL's name with .summary.safetensors, beside it)",
    )
    sm.add_argument(
        "--prior-precision",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="precision of the Gaussian prior on every weight, added to the GGN diagonal (default: 1)",
    )
    sm.add_argument(
        "--float32",
        action="store_true",
        help="keep the weights' precisions and the output Gram in float32 (a version 4 summary: twice their bytes), "
        "not bfloat16",
    )
    sm.add_argument("--force", action="store_true", help="replace an existing summary file")
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from bayesfuse.demo import DemoConfig, hyper_for_methods, run_demo

    config = DemoConfig(
        dataset=args.dataset,
        n_clients=args.clients,
        alpha=args.alpha,
        seed=args.seed,
        hidden=args.hidden,
        epochs=args.epochs,
        shared_init=args.shared_init,
        holdout=args.holdout,
        data_path=args.data_path,
        arch=args.arch,
        channels=args.channels,
        width=args.width,
        methods=args.methods,
        retrain_epochs=args.retrain_epochs,
        pan=args.pan,
        hyper=hyper_for_methods(args.hyper, args.methods),
    )
    result = run_demo(config, seeds=args.seeds, out=args.out, force=args.force, verbose=False if args.quiet else None)
    p = result.partition
    print(
        f"{config.dataset}: {config.n_clients} clients, Dirichlet alpha={config.alpha}, "
        f"client sizes {p.sizes.min()}..{p.sizes.max()}, "
        f"classes per client {int((p.counts > 0).sum(1).min())}..{int((p.counts > 0).sum(1).max())}"
        + (f" (seed {result.seeds[0]})" if len(result.seeds) > 1 else "")
    )
    print(f"local training: {result.train_seconds:.1f} s in all\n")
    print(result.table())
    print(
        "\n"
        + (f"mean ± sd over seeds {', '.join(map(str, result.seeds))}; " if len(result.seeds) > 1 else "")
        + "hidden: hidden units (and channels) of the global model; rounds: communication rounds after "
        "local training; seconds: time to build the global model (after an untimed warm-up)"
    )
    if result.files:
        print("wrote " + ", ".join(str(f) for f in result.files.values()))
    return 0


def _checked_fuse(args: argparse.Namespace) -> dict:
    """What ``bayesfuse fuse`` can refuse before torch is imported (the method, in any case,
    one that fuses files alone, its hyper-parameters' keys and values, a device it cannot use,
    a single model, a directory as ``--out``); the method's name is made the table's. Returns
    the typed hyper-parameters."""
    from bayesfuse import methods
    from bayesfuse._io import check_output_file

    args.method = methods.canonical(args.method)
    hyper = methods.parse_assignments(args.method, args.hyper)
    methods.check_one_shot(args.method)
    methods.check_execution(args.method, None, args.device)
    if args.arch_spec is not None and args.arch != "auto":
        raise ValueError(f"--arch-spec gives the architecture; --arch {args.arch} would be ignored: give one of them")
    if len(args.models) < 2:
        raise ValueError(
            f"one model file given ({args.models[0]}); fusion needs two or more (one model would come back as itself)"
        )
    check_output_file(args.out)
    if args.input_shape is not None and args.model is None:
        raise ValueError("--input-shape is the shape of --model's input: give --model too")
    return hyper


def _input_shape(text: str) -> tuple[int, ...]:
    """``--input-shape``: positive integers separated by commas."""
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas (1,28,28), got {text!r}")
    return shape


def _user_model(ref: str | None):
    """The network ``--model`` names (:func:`~bayesfuse.nets.user_module.model_from_reference`), or None."""
    if ref is None:
        return None
    from bayesfuse.nets.user_module import model_from_reference

    return model_from_reference(ref)


def _zeros(shape: tuple[int, ...], model=None):
    """Two inputs of ``shape``, zeros: what ``--input-shape`` traces ``--model`` with; integer
    zeros (token ids) where ``model`` runs on those and not on floating ones (an nn.Embedding first)."""
    import torch

    from bayesfuse.nets.state import forward_error

    x = torch.zeros((2, *shape))
    if model is not None and forward_error(model, x) is not None and forward_error(model, x.long()) is None:
        return x.long()
    return x


def _run_fuse(args: argparse.Namespace) -> int:
    hyper = _checked_fuse(args)  # before torch is imported: argument errors are answered at once
    from bayesfuse.fuse_files import check_outputs_not_inputs, fuse_files, read_class_counts
    from bayesfuse.fusion_record import fusion_files
    from bayesfuse.inference.result import ConvergenceWarning

    if args.class_counts is not None:  # a file only the command line reads
        check_outputs_not_inputs(fusion_files(args.out), [args.class_counts])
    with warnings.catch_warnings():  # the report records convergence; said once below
        warnings.simplefilter("ignore", ConvergenceWarning)
        report = fuse_files(
            args.models,
            args.method,
            args.out,
            hyper=hyper,
            fmt=args.format,
            force=args.force,
            seed=args.seed,
            arch=args.arch,
            spec_path=args.arch_spec,
            device=args.device,
            dtype=args.dtype,
            class_counts=None if args.class_counts is None else read_class_counts(args.class_counts),
            summaries=args.summaries,
            like=(like := _user_model(args.model)),
            example_input=None if args.input_shape is None else _zeros(args.input_shape, like),
            head=args.head,
            pool=args.pool,
            pseudo_count=args.pseudo_count,
        )
    used = report["summaries"].get("used", False)
    *written, last = [
        args.out,
        f"{args.out}.json",
        *(report[k]["file"] for k in ("posterior", "heads", "fusion_record") if report[k]),
    ]
    held = (report.get("hyper") or {}).get("fixed") or {}
    print(
        f"fused {len(args.models)} models with {args.method} "
        f"({'with their client summaries' if used else 'data-free'}): global sizes {report['global_sizes']}"
        f"{' (' + ', '.join(held) + ' held at the widths the forward fixes)' if held else ''}; "
        f"wrote {', '.join(written)} and {last} ({report['seconds']:.1f} s)"
    )
    in_place = (report.get("hyper") or {}).get("in_place") or {}
    if in_place:
        print(f"kept in place (numbers along their units that no permutation moves): {'; '.join(in_place)}")
    source = (report.get("architecture") or {}).get("source") or ""
    if source.startswith("entry names"):
        print(f"architecture read from the files' {source} (give --model MODULE:NAME to trace it from the network)")
    elif source.startswith("none"):
        print(f"no units traced: {_in_cli_words(source.removeprefix('none, '))}")
    inner = [f"{f['path']}[{f['state_dict_key']!r}]" for f in report["inputs"] if f.get("state_dict_key")]
    if inner:
        print(
            f"note: {'a checkpoint dict' if len(inner) == 1 else 'checkpoint dicts'}: fused the state_dict in "
            f"{', '.join(inner)} (state_dict_key in {args.out}.json)",
            file=sys.stderr,
        )
    if not report["converged"]:
        late = [layer["group"] for layer in report["layers"] if not layer["converged"]]
        print(
            f"warning: the matching of {', '.join(late)} did not converge; raise n_iter (--hyper n_iter=...)",
            file=sys.stderr,
        )
    return 0


#: Library messages name Python arguments; on the command line they are flags.
_FLAGS = (
    ("force=True (--force on the command line)", "--force"),
    ("force=True", "--force"),
    ("overwrite=True", "--force"),
    ("fmt='pt' or 'safetensors'", "--format pt or safetensors"),
    ("arch='mlp'", "--arch mlp"),
    ("arch='cnn'", "--arch cnn"),
    ("arch='lstm'", "--arch lstm"),
    ("like=model", "--model MODULE:NAME"),
    ("pass --model MODULE:NAME if", "give --model MODULE:NAME if"),
    ("with bayesfuse.summarize", "with bayesfuse summarize MODEL --data DATA"),
    ("spec_path=", "--arch-spec "),
    ("device=", "--device "),
    ("dtype=", "--dtype "),
    ("summaries='none'", "--summaries none"),
    ("example_input=...: a batch of your data", "--input-shape D,...: the shape of one input"),
    ("example_input=...", "--input-shape D,..."),
)


def _in_cli_words(message: str) -> str:
    for python, flag in _FLAGS:
        message = message.replace(python, flag)
    return re.sub(r"\bmethod='([\w-]+)'", r"--method \1", message)


#: Hints for file-system errors whose strerror alone does not say what to do.
_OS_HINTS = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EFBIG: "larger than this process may write; see the file-size limit, ulimit -f",
    errno.EROFS: "the file system is mounted read-only; write elsewhere",
    errno.EDQUOT: "the disk quota is used up; free some space or write elsewhere",
}


def _os_error_message(err: OSError) -> str:
    """One line naming the path(s) and the reason of a file-system error."""
    if err.strerror is None:  # raised with a message of its own
        return str(err)
    where = " -> ".join(os.fsdecode(f) for f in (err.filename, err.filename2) if f is not None)
    hint = _OS_HINTS.get(err.errno) if err.errno is not None else None
    message = f"{where}: {err.strerror}" if where else err.strerror
    return f"{message} ({hint})" if hint else message


def _memory_error_message(err: MemoryError) -> str:
    detail = f" ({err})" if str(err) else ""
    return f"out of memory{detail}; the inputs are too large for this machine's memory"


@contextlib.contextmanager
def _warnings_as_notes(command: str):
    """Warnings said as the errors are: one line on stderr, in the command line's words, without
    Python's source line (``bayesfuse summarize: note: ...``)."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"bayesfuse {command}: note: {_in_cli_words(plain_line(str(message)))}", file=sys.stderr)

    before = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = before


def _error(command: str, message: str) -> int:
    message = _in_cli_words(plain_line(message))  # one line without escape codes, in the command line's words
    print(f"bayesfuse {command}: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _run_summarize(args: argparse.Namespace) -> int:
    from bayesfuse.summary_files import summarize_file

    done = summarize_file(
        args.model,
        args.data,
        out=args.out,
        prior_precision=args.prior_precision,
        force=args.force,
        precisions="float32" if args.float32 else "bfloat16",
        like=_user_model(args.network),
    )
    print(
        f"wrote {done['path']}: {done['bytes']:,} bytes, {done['bytes'] / done['model_bytes']:.2f}x the model's "
        f"{done['model_bytes']:,}; {done['n_examples']} examples, {done['seconds']:.1f} s"
    )
    if done["state_dict_key"]:
        print(f"note: a checkpoint dict: summarised the state_dict in {args.model}[{done['state_dict_key']!r}]")
    return 0


def _run_methods(args: argparse.Namespace) -> int:
    import shutil

    from bayesfuse import methods

    width = min(shutil.get_terminal_size().columns, 100) - 2
    if args.name is None:
        print("fusion methods [the kinds of input they fuse]; bayesfuse fuse takes those that need no data:")
        print(methods.listing(width=width))
        print("\nbayesfuse methods NAME lists a method's hyper-parameters and their defaults.")
    else:
        print(methods.describe([methods.canonical(args.name)], width=width, kind=args.kind))
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "summarize":
        return _run_summarize(args)
    if args.command == "methods":
        return _run_methods(args)
    return _run_fuse(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``bayesfuse``; return the exit status (see :data:`EXIT_STATUS`).

    Errors the user can cause or fix (``ValueError``, ``TypeError``, ``RuntimeError``, every
    ``OSError`` and ``MemoryError``) end with one line on stderr and :data:`EXIT_ERROR`; Ctrl-C
    ends with ``bayesfuse CMD: interrupted`` and :data:`EXIT_INTERRUPTED`. Other exceptions
    (assertions, index errors: bugs) propagate with their traceback.
    """
    command = "?"
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the subcommand, whose --help lists its options
            _Parser(prog=f"{parser.prog} {args.command}").error(f"unrecognized arguments: {' '.join(extra)}")
        command = args.command
        with _warnings_as_notes(command):
            return _run(args)
    except KeyboardInterrupt:
        print(f"bayesfuse{'' if command == '?' else ' ' + command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, TypeError, RuntimeError) as err:
        return _error(command, str(err))
    except BrokenPipeError:  # the reader went away (bayesfuse methods | head): nothing more to say
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return EXIT_ERROR
    except OSError as err:
        return _error(command, _os_error_message(err))
    except MemoryError as err:
        return _error(command, _memory_error_message(err))


if __name__ == "__main__":
    sys.exit(main())
