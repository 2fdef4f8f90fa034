"""Run every benchmark (``make bench``) and keep their output in ``bench-results/``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["bench_training.py", "bench_matching.py", "bench_klfusion.py", "bench_mixture_fusion.py",
              "bench_bnn_fusion.py", "bench_baselines.py", "bench_deep.py", "bench_fedma_sizes.py",
              "bench_fidelity.py", "bench_calibration.py", "bench_scale.py", "bench_wide_floor.py",
              "bench_stopping.py"]


def main() -> int:
    out_dir = HERE.parent / "bench-results"
    out_dir.mkdir(exist_ok=True)
    failed = []
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        proc = subprocess.run([sys.executable, str(HERE / name)], capture_output=True, text=True)
        print(proc.stdout, end="")
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            failed.append(name)
        (out_dir / f"{Path(name).stem}.txt").write_text(proc.stdout)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
