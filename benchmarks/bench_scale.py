"""Scale: KL-fusion for tens to a hundred clients, matching for a thousand, wide layers.

Usage: python benchmarks/bench_scale.py [--parts kl match wide conv resnet18 vit device] [--kl-clients 5 20 50 100]
       [--match-clients 30 300 1000] [--device-clients 30 300] [--wide-backends numpy cuda-float32 ...]
       [--wide-tols default 1 ...] [--resnet18-widths 1] [--resnet18-backends numpy cuda-float32 ...]
       [--vit-widths 8] [--data-path DIR] [--cache DIR]

Every case runs in a fresh Python process, so ``peak`` is that case's own peak resident memory
(inputs included; the inputs' size is printed beside it). The ``conv`` and ``resnet18``/``vit``
cases count from the fusion's start: the memory their setup freed is handed back and the peak
restarted first (Linux, glibc; see ``_start_peak``).

* ``kl``: ``kl_fuse`` (defaults: heterogeneous, ``reg = 0.1``, solver "auto") on J clients x
  150 diagonal Gaussians, D = 794, drawn from 300 true components (twice a client's count) as
  in ``bench_klfusion.py``.
* ``match``: ``match_neurons`` with its defaults (every hyper-parameter "auto") on J clients x
  100 neurons, D = 794, drawn from 200 atoms ~ N(0, 1) plus N(0, 0.1^2) noise.
* ``wide``: ``bayesfuse fuse --method pfnm`` (library call ``fuse_files``) on 10 Fashion-MNIST
  MLPs 784-1000-10 trained for 2 epochs each on a Dirichlet(0.5) split (trained once and kept
  in ``--cache``); needs Fashion-MNIST (``make data``). ``--wide-backends`` times it with the
  matching's arithmetic elsewhere too (``fuse_files(..., device=, dtype=)``: ``cpu-float64``,
  ``cuda-float32``...; NumPy alone by default); ``agrees`` compares the partition with NumPy's.
  ``--wide-tols`` runs it at each matching ``tol`` (nats per unit; "default", the method's own,
  alone by default): ``--wide-tols default 1`` shows the speed setting beside the default.
* ``conv``: ``fuse(..., "pfnm")`` on 10 ConvNets whose conv layer has 512 channels
  (``make_cnn(784 -> 1x28x28, channels=(512,), hidden=(64,))``), clients being permuted copies
  of one random network plus N(0, 0.01^2) noise on every weight (no training needed to time it).
  Goal: at most 1.5 GB (what the matching of the dense layer, (640, 100,363), holds: see
  benchmarks/README.md).
* ``resnet18``: ``fuse(..., "pfnm")`` on 10 ResNet-18 clients (``bayesfuse.nets.resnet.resnet18``,
  11.2M parameters each at width 1; ``--resnet18-widths`` for others), permuted copies of one
  random network (every residual stream and inner layer permuted) plus noise of a tenth of each
  entry's standard deviation (an absolute N(0, 0.01^2) would exceed the weights of the
  512-channel convolutions themselves, sd 0.0085); ``--resnet18-backends`` runs the matching's
  arithmetic on a torch device too (``fuse(..., device=, dtype=)``). Goal: at most 2 minutes and 4 GB;
  ``found`` is the fused network's units against one client's, ``recovery`` the groups whose
  global width is the client's.
* ``vit``: the same on 10 vision transformers (``bayesfuse.nets.vit``, stream 32 x W, 4 heads of
  8 x W, MLP 64 x W, 2 blocks; ``--vit-widths``, 8 by default: 1.1M parameters each), every group
  and the heads of every block permuted at random; the heads are aligned before matching
  (``bayesfuse.inference.heads``); ``--resnet18-backends`` applies to it too.

* ``device``: the ``match`` problem (J clients x 100 neurons, D = 794, every hyper-parameter
  "auto") with the neurons as NumPy arrays, as torch CPU tensors in float64 and float32, and as
  CUDA tensors in float64 and float32 when ``torch.cuda.is_available()``: the cost products and
  atom posteriors then run with torch on that device (``match_neurons`` with tensors). ``agrees``
  says whether the partition equals the NumPy one.

``recovery`` is the pair precision / recall of the co-assignments against the truth (1/1:
exact); ``found`` the number of global components or units against the truth.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import RESULTS, simulate_posteriors, wide_models

from bayesfuse.metrics import pair_scores, partition_labels

D = 794


def _peak_mb() -> float:
    """Peak resident memory: since :func:`_start_peak` on Linux (VmHWM), else of the whole process."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _start_peak() -> None:
    """Before a timed fusion: hand the setup's freed memory back to the system (glibc's
    ``malloc_trim``; making ten noisy clients leaves about 250 MB of it) and restart the peak
    (``/proc/self/clear_refs``), so that ``peak`` is the fusion's, with its inputs and the imports,
    as a process that loaded the clients from files would see it. Where either is missing (not
    Linux, not glibc) the peak is the whole run's."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------- cases


def _backend(backend: str) -> tuple[str | None, str]:
    """``(device, dtype)`` of a backend: "numpy" (None, float64) or "DEVICE-DTYPE"; a CUDA device's
    context is started here, outside the timing."""
    if backend == "numpy":
        return None, "float64"
    device, dtype = backend.rsplit("-", 1)
    if device.startswith("cuda"):
        import torch

        torch.ones(1, device=device).sum().item()
    return device, dtype


def case_kl(n_clients: int) -> dict:
    import warnings

    from bayesfuse.inference.klfusion import kl_fuse

    posteriors, truth = simulate_posteriors(n_clients, 150, 300, D)
    inputs_mb = sum(q.loc.nbytes + q.var.nbytes for q in posteriors) / 2**20
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence is reported in the row
        res = kl_fuse(posteriors)
    seconds = time.perf_counter() - start
    precision, recall = pair_scores(truth, res.assignments)
    return dict(
        problem=f"kl_fuse J={n_clients} x 150, D={D}",
        seconds=seconds,
        peak_mb=_peak_mb(),
        inputs_mb=inputs_mb,
        found=f"{res.n_global}/{len(np.unique(np.concatenate(truth)))}",
        recovery=f"{precision:.3f}/{recall:.3f}",
        steps=len(res.objective),
        converged=res.converged,
    )


def case_match(n_clients: int) -> dict:
    import warnings

    from bayesfuse.inference.matching import match_neurons

    layers, truth = _match_problem(n_clients)
    inputs_mb = sum(v.nbytes for v in layers) / 2**20
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = match_neurons(layers, seed=0)
    seconds = time.perf_counter() - start
    precision, recall = pair_scores(truth, res.assignments)
    return dict(
        problem=f"match_neurons J={n_clients} x 100, D={D}",
        seconds=seconds,
        peak_mb=_peak_mb(),
        inputs_mb=inputs_mb,
        found=f"{res.n_global}/{len(np.unique(np.concatenate(truth)))}",
        recovery=f"{precision:.3f}/{recall:.3f}",
        steps=res.n_sweeps,
        converged=res.converged,
    )


def _match_problem(n_clients: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """J clients x 100 neurons drawn from 200 atoms ~ N(0, 1) plus N(0, 0.1^2) noise."""
    rng = np.random.default_rng(n_clients)
    atoms = rng.normal(size=(200, D))
    layers, truth = [], []
    for _ in range(n_clients):
        idx = rng.choice(len(atoms), 100, replace=False)
        layers.append(atoms[idx] + 0.1 * rng.normal(size=(100, D)))
        truth.append(idx)
    return layers, truth


def case_device(n_clients: int, backend: str) -> dict:
    """``match_neurons`` on :func:`_match_problem` with the neurons in ``backend``: "numpy", or
    "DEVICE-DTYPE" torch tensors (``cpu-float64``, ``cuda-float32``...)."""
    import hashlib
    import warnings

    from bayesfuse.inference.matching import match_neurons

    layers, truth = _match_problem(n_clients)
    sync = lambda: None  # noqa: E731
    if backend != "numpy":
        import torch

        device, dtype = backend.rsplit("-", 1)
        layers = [torch.as_tensor(v, dtype=getattr(torch, dtype), device=device) for v in layers]
        if device.startswith("cuda"):
            sync = torch.cuda.synchronize
            torch.ones(1, device=device).sum().item()  # start the CUDA context outside the timing
    inputs_mb = sum(v.nbytes for v in layers) / 2**20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        match_neurons([v[:5] for v in layers[:3]], seed=0)  # load the backend's kernels outside the timing
        sync()
        start = time.perf_counter()
        res = match_neurons(layers, seed=0)
    sync()
    seconds = time.perf_counter() - start
    precision, recall = pair_scores(truth, res.assignments)
    return dict(
        problem=f"match_neurons J={n_clients} x 100, D={D}, {backend}",
        seconds=seconds,
        peak_mb=_peak_mb(),
        inputs_mb=inputs_mb,
        found=f"{res.n_global}/{len(np.unique(np.concatenate(truth)))}",
        recovery=f"{precision:.3f}/{recall:.3f}",
        steps=res.n_sweeps,
        converged=res.converged,
        partition=hashlib.sha1(partition_labels(res.assignments).tobytes()).hexdigest()[:12],
    )


def _device_backends() -> list[str]:
    """NumPy, torch CPU, and CUDA when this machine has it (asked in a child process, so that the
    driver loads no torch)."""
    code = "import torch; print(torch.cuda.is_available())"
    cuda = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"
    return ["numpy", "cpu-float64", "cpu-float32"] + (["cuda-float64", "cuda-float32"] if cuda else [])


def case_wide(cache: str, backend: str = "numpy", tol: str = "default", data_path: str | None = None) -> dict:
    """``fuse_files`` of the wide MLPs, the matching's arithmetic in ``backend``: "numpy", or
    "DEVICE-DTYPE" (``cpu-float64``, ``cuda-float32``...); ``tol`` the matching's stopping gain
    in nats per unit, or "default" (the method's own)."""
    import hashlib
    import tempfile
    import warnings

    from bayesfuse.fuse_files import fuse_files

    files = wide_models(Path(cache), data_path)
    inputs_mb = sum(f.stat().st_size for f in files) / 2**20
    device, dtype = _backend(backend)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        report = fuse_files(
            files,
            "pfnm",
            Path(tmp) / "fused.pt",
            device=device,
            dtype=dtype,
            hyper=None if tol == "default" else {"tol": float(tol)},
        )
        seconds = time.perf_counter() - start
    assignments = json.dumps([layer["assignments"] for layer in report["layers"]]).encode()
    setting = backend if tol == "default" else f"{backend}, tol={tol}"
    return dict(
        problem=f"bayesfuse fuse 10 x 784-1000-10 (pfnm, {setting})",
        seconds=seconds,
        peak_mb=_peak_mb(),
        inputs_mb=inputs_mb,
        found=f"{report['global_sizes'][0]}/-",
        recovery="-",
        steps=sum(len(layer["objective"]) for layer in report["layers"]),
        converged=report["converged"],
        partition=hashlib.sha1(assignments).hexdigest()[:12],
    )


def _noisy_copies(model, spec, n: int, rng: np.random.Generator, noise) -> list:
    """``n`` copies of ``model`` with every group of ``spec`` (and its heads, if it has any) permuted
    at random and ``noise(v)`` (an array of ``v``'s shape) added to every floating entry ``v`` but scalars."""
    import torch

    from bayesfuse.inference.heads import rename_heads
    from bayesfuse.inference.spec import permute, random_permutations
    from bayesfuse.nets.arch import rebuild
    from bayesfuse.nets.state import numpy_state

    state = numpy_state(model.state_dict())
    clients = []
    for _ in range(n):
        perms = random_permutations(spec.sizes(state), rng)
        moved = rename_heads(permute(state, spec, perms), spec, {h: rng.permutation(len(h)) for h in spec.heads})
        noisy = {k: v + noise(v) if v.dtype.kind == "f" and v.ndim > 0 else v for k, v in moved.items()}
        clients.append(rebuild(model, {k: torch.as_tensor(v, dtype=torch.float32) for k, v in noisy.items()}))
    return clients


def case_conv() -> dict:
    import warnings

    import torch

    from bayesfuse import fuse
    from bayesfuse.nets.arch import make_cnn
    from bayesfuse.nets.spec import spec_from_module

    torch.manual_seed(0)
    model = make_cnn(784, 10, channels=(512,), hidden=(64,)).eval()
    spec = spec_from_module(model, torch.zeros(2, 784))
    rng = np.random.default_rng(0)
    clients = _noisy_copies(model, spec, 10, rng, lambda v: 0.01 * rng.normal(size=v.shape))
    del model
    inputs_mb = sum(p.numel() * 4 for m in clients for p in m.parameters()) / 2**20
    _start_peak()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        res = fuse(clients, "pfnm", spec=spec)
        seconds = time.perf_counter() - start
    return dict(
        problem="fuse 10 ConvNets, 512-channel conv layer (pfnm)",
        seconds=seconds,
        peak_mb=_peak_mb(),
        inputs_mb=inputs_mb,
        found="/".join(map(str, res.sizes)),
        recovery="-",
        steps="-",
        converged=res.converged,
    )


#: Parts of the run, in order.
PARTS = ("kl", "match", "wide", "conv", "resnet18", "vit", "device")
#: The reference networks timed at full size: default width multiplier and what it gives.
NETWORKS = {"resnet18": (1.0, "11.2M parameters per client"), "vit": (8.0, "1.1M parameters per client")}


def case_network(width: float = 1.0, backend: str = "numpy", arch: str = "resnet18") -> dict:
    """``fuse(..., "pfnm")`` on ten ResNet-18 clients (:func:`bayesfuse.nets.resnet.resnet18`, 11.2M
    parameters each at width 1; or ``arch="vit"``, :func:`bayesfuse.nets.attention.vit`): permuted
    copies of one random network, every entry plus noise of a tenth of its own standard deviation.
    ``recovery``: the share of groups whose global width is the network's (every client's units
    matched to their own)."""
    import warnings

    import torch

    from bayesfuse import fuse
    from bayesfuse.nets.arch import make_model
    from bayesfuse.nets.spec import spec_from_module

    torch.manual_seed(0)
    model = make_model(arch, 784, 10, width=width).eval()
    if arch == "vit":
        with torch.no_grad():
            model.pos.normal_()  # position embeddings of order 1, not the initial 0.02
    spec = spec_from_module(model)
    rng = np.random.default_rng(0)
    clients = _noisy_copies(model, spec, 10, rng, lambda v: 0.1 * v.std() * rng.normal(size=v.shape))
    widths = list(spec.sizes(model.state_dict()).values())
    del model
    inputs_mb = sum(p.numel() * 4 for m in clients for p in m.parameters()) / 2**20
    n_params = sum(p.numel() for p in clients[0].parameters())
    device, dtype = _backend(backend)
    _start_peak()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        res = fuse(clients, "pfnm", spec=spec, device=device, dtype=dtype)
        seconds = time.perf_counter() - start
    recovered = sum(g == w for g, w in zip(res.sizes, widths))
    return dict(
        problem=f"fuse 10 {'ViT' if arch == 'vit' else 'ResNet-18'} x {width:g} ({n_params / 1e6:.1f}M parameters "
        f"each, pfnm, {backend})",
        seconds=seconds,
        peak_mb=_peak_mb(),
        inputs_mb=inputs_mb,
        found=f"{sum(res.sizes)}/{sum(widths)}",
        recovery=f"{recovered}/{len(widths)} groups",
        steps=sum(layer.n_sweeps for layer in res.layers),
        converged=res.converged,
    )


# ---------------------------------------------------------------------------------- driver


def _tol(text: str) -> str:
    """``--wide-tols`` values: "default" or a number >= 0, kept as text (they travel as arguments)."""
    try:
        ok = text == "default" or float(text) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"tol must be a number >= 0 or 'default', got {text!r}")
    return text


def _run_case(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--case", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        return dict(
            problem=" ".join(args),
            seconds=float("nan"),
            peak_mb=float("nan"),
            inputs_mb=float("nan"),
            found="-",
            recovery=f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr else '?'}",
            steps="-",
            converged="-",
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=list(PARTS),
        choices=PARTS,
    )
    parser.add_argument("--kl-clients", type=int, nargs="+", default=[5, 20, 50, 100])
    parser.add_argument("--match-clients", type=int, nargs="+", default=[30, 300, 1000])
    parser.add_argument("--device-clients", type=int, nargs="+", default=[30, 300])
    for arch, (width, size) in NETWORKS.items():
        parser.add_argument(
            f"--{arch}-widths",
            type=float,
            nargs="+",
            default=[width],
            metavar="WIDTH",
            help=f"width multipliers of the {arch} case (default: {width:g}, {size})",
        )
    parser.add_argument(
        "--resnet18-backends",
        nargs="+",
        default=["numpy"],
        metavar="BACKEND",
        help="numpy, or DEVICE-DTYPE such as cuda-float32 (default: numpy)",
    )
    parser.add_argument(
        "--wide-backends",
        nargs="+",
        default=["numpy"],
        metavar="BACKEND",
        help="numpy, or DEVICE-DTYPE such as cpu-float64 or cuda-float32 (default: numpy)",
    )
    parser.add_argument(
        "--wide-tols",
        nargs="+",
        default=["default"],
        metavar="TOL",
        type=_tol,
        help="the wide case at each matching tol (nats per unit; 'default': the method's own)",
    )
    parser.add_argument("--data-path", default=None, help="Fashion-MNIST IDX directory (default: the Debian one)")
    parser.add_argument("--cache", default=str(RESULTS / "wide-mlps"), help="where the trained wide MLPs are kept")
    parser.add_argument("--case", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        kind, *rest = args.case
        if kind == "kl":
            row = case_kl(int(rest[0]))
        elif kind == "match":
            row = case_match(int(rest[0]))
        elif kind == "wide":
            row = case_wide(rest[0], rest[1], rest[2], rest[3] if len(rest) > 3 else None)
        elif kind == "device":
            row = case_device(int(rest[0]), rest[1])
        elif kind in NETWORKS:
            row = case_network(float(rest[0]), rest[1], kind)
        else:
            row = case_conv()
        print(json.dumps(row))
        return

    from bayesfuse.demo import format_table

    plan = []
    if "kl" in args.parts:
        plan += [["kl", str(j)] for j in args.kl_clients]
    if "match" in args.parts:
        plan += [["match", str(j)] for j in args.match_clients]
    if "wide" in args.parts:
        plan += [
            ["wide", args.cache, b, t, *([args.data_path] if args.data_path else [])]
            for t in args.wide_tols
            for b in args.wide_backends
        ]
    if "conv" in args.parts:
        plan.append(["conv"])
    for arch in NETWORKS:
        if arch in args.parts:
            widths = getattr(args, f"{arch}_widths")
            plan += [[arch, str(w), b] for w in widths for b in args.resnet18_backends]
    if "device" in args.parts:
        plan += [["device", str(j), b] for j in args.device_clients for b in _device_backends()]
    rows = []
    for case in plan:
        row = _run_case(case)
        rows.append(row)
        print(f"{row['problem']}: {row['seconds']:.1f} s, peak {row['peak_mb']:.0f} MB", file=sys.stderr, flush=True)
    reference = {}  # the NumPy partition of each device problem and of the wide layers (at each tol)
    problem = lambda case: (case[0], case[1], *case[3:4])  # noqa: E731  (kind, clients or cache, tol)
    for case, row in zip(plan, rows):
        if case[0] in ("device", "wide") and case[2] == "numpy":
            reference[problem(case)] = row.get("partition")
    for case, row in zip(plan, rows):
        row["agrees"] = "-"
        if case[0] in ("device", "wide") and "partition" in row:
            partition = row.pop("partition")
            if case[2] != "numpy" and problem(case) in reference:
                row["agrees"] = "yes" if partition == reference[problem(case)] else "no"
        row["seconds"] = f"{row['seconds']:.1f}"
        row["peak MB"] = f"{row.pop('peak_mb'):.0f}"
        row["inputs MB"] = f"{row.pop('inputs_mb'):.0f}"
    print(
        format_table(
            rows, ["problem", "seconds", "peak MB", "inputs MB", "found", "recovery", "steps", "converged", "agrees"]
        )
    )


if __name__ == "__main__":
    main()
