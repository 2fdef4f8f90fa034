"""Speed and recovery of BBP-MAP matching on IBP-simulated federations shaped like MNIST.

Usage: python benchmarks/bench_matching.py [--clients 10 30 100] [--sweeps 5] [--threads N]

Each federation comes from the Pyro model (``simulate_federation``): D = 784 + 10 (a hidden
unit's incoming and outgoing weights), gamma0 = 100 (about 100 neurons per client), atoms
~ N(0, 1), noise variance 0.01 (sd 0.1, well below the atoms' spread). Rows:

* ``pfnm``     PFNM cost, noise_var = 1 (the usual over-stated value)
* ``nafi``     PFNM cost + 0.1 x KL penalty, noise_var = 1
* ``marginal`` exact collapsed cost at the true noise_var = 0.01
* ``pfnm@true`` PFNM cost at the true noise_var (shows PFNM's over-splitting)
* ``auto``     every hyper-parameter chosen from the neurons (empirical Bayes, the default);
  ``sweeps`` are those of its last matching, ``seconds`` all of its rounds

``floor`` is the time of the bare matrix products the cost matrices need (one
(G+1) x D x L_j GEMM per client visit, at the final G); ``ratio`` = seconds / floor.
Pair precision / recall: of pairs of neurons put on one atom, the share that truly share one,
and of truly shared pairs, the share found.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bayesfuse.demo import format_table
from bayesfuse.inference.matching import match_neurons
from bayesfuse.metrics import pair_scores
from bayesfuse.models.bbp import simulate_federation

D, GAMMA0, NOISE = 794, 100.0, 0.01
RUNS = [
    ("pfnm", dict(cost="pfnm", noise_var=1.0)),
    ("nafi", dict(cost="pfnm", noise_var=1.0, kl_weight=0.1)),
    ("marginal", dict(cost="marginal", noise_var=NOISE)),
    ("pfnm@true", dict(cost="pfnm", noise_var=NOISE)),
    ("auto", dict(noise_var="auto", prior_var="auto", gamma0="auto")),
]


def gemm_floor(n_global: int, layers: list[np.ndarray], sweeps: int, repeats: int = 3) -> float:
    rng = np.random.default_rng(0)
    h = rng.normal(size=(n_global + 1, D))
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(sweeps):
            for v in layers:
                h @ v.T
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 30, 100])
    parser.add_argument("--sweeps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="BLAS threads (default: library default)")
    args = parser.parse_args()
    if args.threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads)
    rows = []
    for J in args.clients:
        start = time.perf_counter()
        fed = simulate_federation(J, D, gamma0=GAMMA0, prior_var=1.0, noise_var=NOISE, seed=J)
        sim = time.perf_counter() - start
        sizes = [len(v) for v in fed.layers]
        print(
            f"J={J}: {fed.n_atoms} true atoms, {np.mean(sizes):.0f} neurons per client "
            f"({min(sizes)}..{max(sizes)}), simulated in {sim:.1f} s",
            flush=True,
        )
        for name, hyper in RUNS:
            if name == "pfnm@true" and J > 30:
                continue  # over-splitting makes G, and the run, large; J <= 30 shows it
            res = match_neurons(fed.layers, **{"prior_var": 1.0, "gamma0": GAMMA0, **hyper}, n_iter=args.sweeps, seed=0)
            precision, recall = pair_scores(fed.assignments, res.assignments)
            floor = gemm_floor(res.n_global, fed.layers, res.n_sweeps)
            rows.append(
                {
                    "J": J,
                    "method": name,
                    "sweeps": res.n_sweeps,
                    "seconds": res.seconds,
                    "floor": floor,
                    "ratio": f"{res.seconds / floor:.1f}",
                    "true": fed.n_atoms,
                    "found": res.n_global,
                    "precision": precision,
                    "recall": recall,
                    "objective": f"{res.objective[-1]:.4g}",
                }
            )
            print(format_table(rows[-1:], list(rows[-1])).splitlines()[-1], flush=True)
    print()
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
