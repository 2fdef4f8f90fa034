"""Command line: ``bayesfuse demo``, ``bayesfuse fuse`` and ``bayesfuse summarize``.

Exit status: 0 on success; 2 for every failure the user can cause or fix (bad options or inputs,
outputs that exist, unreadable files, a read-only or full output directory, a file-size limit,
not enough memory), reported as one line ``bayesfuse CMD: error: ...`` on stderr with nothing
written; 130 when interrupted (Ctrl-C). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import warnings
from typing import Sequence

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
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
            f"expected comma-separated integers such as 100 or 200,100, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"hidden widths must be positive, got {text!r}")
    return widths


def _methods(text: str) -> tuple[str, ...]:
    from bayesfuse.demo import DEMO_METHODS

    methods = tuple(m.strip() for m in text.split(",") if m.strip())
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
        return PANConfig(mode, period, amplitude)
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


def build_parser() -> argparse.ArgumentParser:
    from bayesfuse import __version__

    parser = argparse.ArgumentParser(prog="bayesfuse", description="Bayesian model fusion toolkit.",
                                     epilog=EXIT_STATUS)
    parser.add_argument("--version", action="version", version=f"bayesfuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from bayesfuse import methods

    demo = sub.add_parser(
        "demo",
        help="simulate a federation, train local MLPs, compare fusion methods",
        description="Split a dataset across clients (Dirichlet heterogeneity), train one MLP per "
        "client, build global models and print a table; write it as CSV/JSON plus a figure.",
    )
    demo.add_argument("--dataset", default="digits", choices=["digits", "fashion-mnist", "mnist"],
                      help="digits ships with scikit-learn; fashion-mnist needs `make data` (default: digits)")
    demo.add_argument("--data-path", default=None,
                      help="directory of IDX files (or mnist .npz) for fashion-mnist / mnist")
    demo.add_argument("--clients", "-J", type=_positive_int, default=10, help="number of clients (default: 10)")
    demo.add_argument("--alpha", type=float, default=0.5,
                      help="Dirichlet concentration of the class split; small is heterogeneous (default: 0.5)")
    seeds = demo.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=_non_negative_int, default=0,
                       help="seed of split, initialisation and training (default: 0)")
    seeds.add_argument("--seeds", type=_non_negative_int, nargs="+", default=None, metavar="SEED",
                       help="run once per seed and report mean +- sd over them, e.g. --seeds 0 1 2")
    demo.add_argument("--hidden", type=_widths, default=(100,),
                      help="hidden widths, e.g. 100 or 200,100 (default: 100)")
    demo.add_argument("--epochs", type=_positive_int, default=10, help="local training epochs (default: 10)")
    demo.add_argument("--shared-init", action="store_true",
                      help="all clients start from one initial network (as FedAvg assumes); "
                      "default: each client draws its own, as separately trained models do")
    demo.add_argument("--arch", default="mlp", choices=["mlp", "cnn", "lstm"],
                      help="local networks: MLP (--hidden), ConvNet (--channels, then --hidden dense layers) "
                      "or LSTM over image rows (first --hidden width) (default: mlp)")
    demo.add_argument("--channels", type=_widths, default=(16, 32),
                      help="cnn: channels of the conv-BN-ReLU-maxpool blocks (default: 16,32)")
    demo.add_argument("--methods", type=_methods, default=methods.names("network", featured=True),
                      help="comma-separated methods after local/ensemble/fedavg, from pfnm, nafi, fedma, "
                      "fedma-nafi, fedavg-rounds (FedAvg with as many rounds as FedMA) (default: pfnm,nafi)")
    demo.add_argument("--retrain-epochs", type=_positive_int, default=None,
                      help="epochs of client training per FedMA/FedAvg round (default: --epochs)")
    demo.add_argument("--pan", type=_pan, default=None, metavar="MODE,T,A",
                      help="position-aware neurons in the hidden layers, e.g. mul,1,0.1 (mode add or mul, "
                      "period T, amplitude A); default: plain neurons")
    demo.add_argument("--out", default="bayesfuse-demo", help="output directory (default: ./bayesfuse-demo)")
    demo.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing the demo's files")
    demo.add_argument("--hyper", nargs="*", default=[], metavar="[METHOD.]KEY=VALUE",
                      help="hyper-parameters of the fusion methods, as in `bayesfuse fuse`: KEY=VALUE for every "
                      "method run that has KEY, METHOD.KEY=VALUE for one (e.g. noise_var=1 nafi.kl_weight=0.1)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")

    fz = sub.add_parser(
        "fuse",
        help="fuse model files (state_dicts) into one",
        description="Fuse MLP, ConvNet, LSTM or HorseshoeBNN checkpoints (.pt/.pth read with "
        "torch.load(weights_only=True), or .safetensors) into one file, plus a JSON report "
        "(OUT.json) that records every hyper-parameter used. The order of the files does not matter.",
        epilog="methods and their hyper-parameters (--hyper KEY=VALUE; defaults per kind of input: "
        "network = point-estimate networks, bnn = HorseshoeBNNs):\n\n" + methods.describe() + "\n\n" + EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fz.add_argument("models", nargs="+", metavar="MODEL", help="checkpoint files")
    fz.add_argument("--method", required=True, help=f"one of {', '.join(methods.names())} (see below)")
    fz.add_argument("--hyper", nargs="*", default=[], metavar="KEY=VALUE", help="hyper-parameters of the method")
    fz.add_argument("--out", required=True, help="fused model file (.pt, .pth or .safetensors)")
    fz.add_argument("--format", choices=["pt", "safetensors"], default=None, help="output format (default: from --out)")
    fz.add_argument("--model", default=None, metavar="REF",
                    help="your network, MODULE:NAME or FILE.py:NAME (called with no arguments): its architecture "
                    "is traced from it (residual nets included) and the fused model is run in it once")
    fz.add_argument("--arch", default="auto", choices=["auto", "mlp", "cnn", "lstm"],
                    help="how to read the files' layers when no --arch-spec or --model is given; mlp or cnn say the "
                    "network is a plain chain (default: auto)")
    fz.add_argument("--arch-spec", default=None, metavar="FILE",
                    help="JSON permutation spec naming which axes of which entries each hidden permutation acts on "
                    "(see bayesfuse.inference.spec.spec_to_dict)")
    fz.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the matching (default: 0)")
    fz.add_argument("--device", default=None, metavar="DEVICE",
                    help="run pfnm/nafi's cost products and posterior means with torch on this device (cpu, cuda, "
                    "cuda:1, mps); the result is the same up to round-off (default: NumPy float64 on the host)")
    fz.add_argument("--dtype", default="float64", choices=["float32", "float64"],
                    help="with --device: the dtype of that arithmetic (default: float64)")
    fz.add_argument("--class-counts", default=None, metavar="FILE",
                    help='JSON object mapping each MODEL (its path as given, or its file name) to its training '
                    'examples per class, e.g. {"client0.pt": [120, 0, 35]}: weights the output layer by the clients\' '
                    "class shares, which matters when they saw different classes")
    fz.add_argument("--summaries", choices=["auto", "none"], default="auto",
                    help="client summaries (bayesfuse summarize): auto uses MODEL's summary beside it "
                    "(model.summary.safetensors) when every MODEL has one and the method reads them (pfnm, nafi), and "
                    "then also writes OUT.posterior.safetensors, the output layer's posterior; none fuses data-free "
                    "(default: auto)")
    fz.add_argument("--force", action="store_true", help="replace existing output files")

    sm = sub.add_parser(
        "summarize",
        help="a client's summary of its own data, beside its model file (for bayesfuse fuse)",
        description="One pass over the client's data: the Laplace precision of every weight (GGN diagonal), "
        "per-unit moments and class counts, written as MODEL's summary (model.pt -> model.summary.safetensors), "
        "where `bayesfuse fuse` reads it. Aggregates only: no example can be read back from it.",
        epilog=EXIT_STATUS,
    )
    sm.add_argument("model", metavar="MODEL", help="the client's model file (.pt, .pth or .safetensors state_dict of "
                    "an MLP, make_cnn ConvNet or LSTMClassifier)")
    sm.add_argument("--data", required=True, metavar="DATA",
                    help="the client's training data: a .npz file with arrays x (inputs) and y (integer labels)")
    sm.add_argument("--out", default=None, metavar="PATH",
                    help="summary file (.safetensors; default: MODEL's name with .summary.safetensors, beside it)")
    sm.add_argument("--prior-precision", type=_positive_float, default=1.0, metavar="X",
                    help="precision of the Gaussian prior on every weight, added to the GGN diagonal (default: 1)")
    sm.add_argument("--force", action="store_true", help="replace an existing summary file")
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from bayesfuse.demo import DemoConfig, hyper_for_methods, run_demo

    config = DemoConfig(
        dataset=args.dataset, n_clients=args.clients, alpha=args.alpha, seed=args.seed,
        hidden=args.hidden, epochs=args.epochs, shared_init=args.shared_init,
        data_path=args.data_path, arch=args.arch, channels=args.channels, methods=args.methods,
        retrain_epochs=args.retrain_epochs, pan=args.pan, hyper=hyper_for_methods(args.hyper, args.methods),
    )
    result = run_demo(config, seeds=args.seeds, out=args.out, force=args.force,
                      verbose=False if args.quiet else None)
    p = result.partition
    print(f"{config.dataset}: {config.n_clients} clients, Dirichlet alpha={config.alpha}, "
          f"client sizes {p.sizes.min()}..{p.sizes.max()}, "
          f"classes per client {int((p.counts > 0).sum(1).min())}..{int((p.counts > 0).sum(1).max())}"
          + (f" (seed {result.seeds[0]})" if len(result.seeds) > 1 else ""))
    print(f"local training: {result.train_seconds:.1f} s in all\n")
    print(result.table())
    print("\n" + (f"mean ± sd over seeds {', '.join(map(str, result.seeds))}; " if len(result.seeds) > 1 else "")
          + "hidden: hidden units (and channels) of the global model; rounds: communication rounds after "
          "local training; seconds: time to build the global model (after an untimed warm-up)")
    if result.files:
        print("wrote " + ", ".join(str(f) for f in result.files.values()))
    return 0


def _user_model(ref: str | None):
    """The network ``--model`` names (:func:`~bayesfuse.nets.user_module.model_from_reference`), or None."""
    if ref is None:
        return None
    from bayesfuse.nets.user_module import model_from_reference

    return model_from_reference(ref)


def _run_fuse(args: argparse.Namespace) -> int:
    from bayesfuse.fuse_files import fuse_files, read_class_counts
    from bayesfuse.inference.result import ConvergenceWarning
    from bayesfuse.methods import parse_assignments

    with warnings.catch_warnings():  # the report records convergence; said once below
        warnings.simplefilter("ignore", ConvergenceWarning)
        report = fuse_files(args.models, args.method, args.out, hyper=parse_assignments(args.method, args.hyper),
                            fmt=args.format, force=args.force, seed=args.seed, arch=args.arch,
                            spec_path=args.arch_spec, device=args.device, dtype=args.dtype,
                            class_counts=None if args.class_counts is None else read_class_counts(args.class_counts),
                            summaries=args.summaries, like=_user_model(args.model))
    source = (report.get("architecture") or {}).get("source") or ""
    if source.startswith("entry names"):
        print(f"architecture read from the files' {source} (give --model MODULE:NAME to trace it from the network)",
              file=sys.stderr)
    used = report["summaries"].get("used", False)
    posterior = f" and {report['posterior']['file']}" if report["posterior"] else ""
    print(f"fused {len(args.models)} models with {args.method} "
          f"({'with their client summaries' if used else 'data-free'}): global sizes {report['global_sizes']}; "
          f"wrote {args.out}, {args.out}.json{posterior} ({report['seconds']:.1f} s)")
    if not report["converged"]:
        late = [layer["group"] for layer in report["layers"] if not layer["converged"]]
        print(f"warning: the matching of {', '.join(late)} did not converge; raise n_iter (--hyper n_iter=...)",
              file=sys.stderr)
    return 0


#: Library messages name Python arguments; on the command line they are flags.
_FLAGS = (("force=True (--force on the command line)", "--force"), ("force=True", "--force"),
          ("overwrite=True", "--force"), ("fmt='pt' or 'safetensors'",
          "--format pt or safetensors"), ("arch='mlp'", "--arch mlp"), ("arch='cnn'", "--arch cnn"),
          ("arch='lstm'", "--arch lstm"),
          ("like=model", "--model MODULE:NAME"), ("spec_path=", "--arch-spec "), ("device=", "--device "),
          ("dtype=", "--dtype "), ("summaries='none'", "--summaries none"))


def _in_cli_words(message: str) -> str:
    for python, flag in _FLAGS:
        message = message.replace(python, flag)
    return message


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
    hint = _OS_HINTS.get(err.errno)
    message = f"{where}: {err.strerror}" if where else err.strerror
    return f"{message} ({hint})" if hint else message


def _memory_error_message(err: MemoryError) -> str:
    detail = f" ({err})" if str(err) else ""
    return f"out of memory{detail}; the inputs are too large for this machine's memory"


def _error(command: str, message: str) -> int:
    message = _in_cli_words(" ".join(message.split()))  # one line, in the command line's words
    print(f"bayesfuse {command}: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _run_summarize(args: argparse.Namespace) -> int:
    from bayesfuse.summary_files import summarize_file

    done = summarize_file(args.model, args.data, out=args.out, prior_precision=args.prior_precision,
                          force=args.force)
    print(f"wrote {done['path']}: {done['bytes']:,} bytes, {done['bytes'] / done['model_bytes']:.2f}x the model's "
          f"{done['model_bytes']:,}; {done['n_examples']} examples, {done['seconds']:.1f} s")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "summarize":
        return _run_summarize(args)
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
        args = parser.parse_args(argv)
        command = args.command
        return _run(args)
    except KeyboardInterrupt:
        print(f"bayesfuse{'' if command == '?' else ' ' + command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, TypeError, RuntimeError) as err:
        return _error(command, str(err))
    except OSError as err:
        return _error(command, _os_error_message(err))
    except MemoryError as err:
        return _error(command, _memory_error_message(err))


if __name__ == "__main__":
    sys.exit(main())
