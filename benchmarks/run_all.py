"""Run the benchmarks and keep their output: ``make bench`` (``--quick``) and ``make bench-full``.

Usage: python benchmarks/run_all.py [--quick] [--only bench_matching.py ...]

Without ``--quick``: every benchmark at its defaults (Fashion-MNIST where it uses a data set;
about an hour on 2 cores), each table kept in ``bench-results/<name>.txt``, and with the machine,
date, time and figures in ``bench-results/<name>.json`` (:func:`common.write_record`; the
documentation's benchmarks page is generated from these). With ``--quick``: each
benchmark's smoke run (:data:`QUICK`: the embedded digits, one seed, few epochs, small
simulated problems; minutes in all), output in ``bench-results/quick/``; the benchmarks that
need Fashion-MNIST or have no small setting (:data:`FULL_ONLY`) are left out. Timings are in
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, write_record

HERE = Path(__file__).resolve().parent
BENCHMARKS = [
    "bench_training.py",
    "bench_matching.py",
    "bench_klfusion.py",
    "bench_mixture_fusion.py",
    "bench_bnn_fusion.py",
    "bench_bnn_pruning.py",
    "bench_baselines.py",
    "bench_deep.py",
    "bench_architectures.py",
    "bench_user_nets.py",
    "bench_model_zoo.py",
    "bench_fedma_sizes.py",
    "bench_fidelity.py",
    "bench_calibration.py",
    "bench_scale.py",
    "bench_wide_floor.py",
    "bench_stopping.py",
    "bench_arviz.py",
    "bench_topics.py",
    "bench_hmm.py",
]

#: Each benchmark's smoke run: its options (``{out}`` is the output folder).
QUICK = {
    "bench_training.py": ["--repeats", "1"],
    "bench_matching.py": ["--clients", "10"],
    "bench_klfusion.py": ["--components", "50", "--true", "100", "--dim", "100"],
    "bench_bnn_fusion.py": [
        "--seeds",
        "0",
        "--epochs",
        "20",
        "--regs",
        "0.01",
        "0.1",
        "--samples",
        "20",
        "--out",
        "{out}",
    ],
    "bench_bnn_pruning.py": ["--quick"],
    "bench_baselines.py": ["--dataset", "digits", "--seeds", "0", "--epochs", "3"],
    "bench_deep.py": [
        "--parts",
        "synthetic",
        "mlp",
        "cnn",
        "pans",
        "--dataset",
        "digits",
        "--epochs",
        "2",
        "--cnn-epochs",
        "1",
        "--retrain-epochs",
        "1",
    ],
    "bench_architectures.py": ["--dataset", "digits", "--seeds", "0", "--epochs", "2", "--train-size", "0"],
    "bench_user_nets.py": ["--seeds", "0", "--epochs", "2"],
    # torchvision's and timm's networks (each library says "skipped" where it is not installed)
    "bench_model_zoo.py": ["--models", "resnet18", "convnext_tiny", "lcnet_050", "--out", "{out}/model_zoo.md"],
    "bench_fedma_sizes.py": ["--dataset", "digits", "--noise-vars", "1", "3"],
    "bench_fidelity.py": ["--quick", "--out", "{out}"],
    "bench_calibration.py": [
        "--dataset",
        "digits",
        "--depths",
        "100",
        "--seeds",
        "0",
        "--inits",
        "shared",
        "--epochs",
        "3",
    ],
    "bench_scale.py": [
        "--parts",
        "kl",
        "match",
        "resnet18",
        "vit",
        "device",
        "--kl-clients",
        "5",
        "--match-clients",
        "30",
        "--device-clients",
        "30",
        "--resnet18-widths",
        "0.25",
        "--vit-widths",
        "2",
    ],
    "bench_arviz.py": ["--repeats", "1"],
    # real data from `make data` (each says "skipped" without it)
    "bench_topics.py": ["--quick", "--out", "{out}"],
    "bench_hmm.py": ["--quick", "--out", "{out}"],
}
#: Left out of ``--quick``: Fashion-MNIST only (the wide MLPs), or no setting small enough.
FULL_ONLY = [name for name in BENCHMARKS if name not in QUICK]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="each benchmark's smoke run (minutes)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, metavar="NAME", help="run these benchmarks alone")
    args = parser.parse_args(argv)
    out_dir = RESULTS / "quick" if args.quick else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [n for n in BENCHMARKS if (not args.only or n in args.only) and (not args.quick or n in QUICK)]
    if args.quick:
        print(
            f"(quick: {', '.join(n for n in FULL_ONLY if not args.only or n in args.only)} left out; "
            "`make bench-full` runs them)",
            flush=True,
        )
    failed = []
    for name in names:
        options = [o.format(out=out_dir) for o in QUICK[name]] if args.quick else []
        print(f"== {name} {' '.join(options)}".rstrip(), flush=True)
        start, started = time.perf_counter(), time.time()
        proc = subprocess.run([sys.executable, str(HERE / name), *options], capture_output=True, text=True)
        seconds = time.perf_counter() - start
        print(proc.stdout, end="")
        print(f"({name}: {seconds:.0f} s)", file=sys.stderr, flush=True)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            failed.append(name)
        (out_dir / f"{Path(name).stem}.txt").write_text(proc.stdout)
        figures = sorted(p.name for p in out_dir.glob("*.png") if p.stat().st_mtime >= started)
        write_record(
            out_dir / f"{Path(name).stem}.json",
            benchmark=name,
            options=options,
            seconds=seconds,
            returncode=proc.returncode,
            output=proc.stdout,
            figures=figures,
            quick=args.quick,
        )
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
