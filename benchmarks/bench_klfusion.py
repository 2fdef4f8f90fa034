"""KL-fusion at the size of a BNN layer: J = 5 clients x 150 diagonal-Gaussian components, D = 794.

Usage: python benchmarks/bench_klfusion.py [--clients 5] [--components 150] [--true 300]
       [--dim 794] [--reg 0.1] [--cvxpy]

Simulation: ``--true`` global components with means ~ N(0, 1) and variances ~ 0.01 x LogNormal;
each client holds a random subset of ``--components`` of them, each seen as a posterior whose
mean is off the truth by N(0, 0.05^2) and whose variance is the truth's times LogNormal(0, 0.1).
Prints each alternation step (seconds, global components, objective), the components found
against the truth with the pair precision / recall of the co-assignment, and peak memory.
With ``--cvxpy`` it also times cvxpy on the first step's relaxed problem (minutes at this size).
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from bayesfuse.demo import format_table
from bayesfuse.inference.expfam import DiagNormal
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.relaxed import relaxed_objective, solve_relaxed


def simulate(n_clients, n_local, n_true, dim, seed=0):
    rng = np.random.default_rng(seed)
    loc = rng.normal(size=(n_true, dim))
    var = 0.01 * np.exp(rng.normal(0, 0.3, size=(n_true, dim)))
    posteriors, truth = [], []
    for _ in range(n_clients):
        idx = rng.choice(n_true, n_local, replace=False)
        posteriors.append(DiagNormal(loc=loc[idx] + rng.normal(0, 0.05, size=(n_local, dim)),
                                     var=var[idx] * np.exp(rng.normal(0, 0.1, size=(n_local, dim)))))
        truth.append(idx)
    return posteriors, truth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--components", type=int, default=150)
    parser.add_argument("--true", type=int, default=300)
    parser.add_argument("--dim", type=int, default=794)
    parser.add_argument("--reg", type=float, default=0.1)
    parser.add_argument("--cvxpy", action="store_true", help="also time cvxpy on the first step")
    args = parser.parse_args()
    from bench_matching import pair_scores  # same folder

    posteriors, truth = simulate(args.clients, args.components, args.true, args.dim)
    n_true = len(np.unique(np.concatenate(truth)))
    res = kl_fuse(posteriors, reg=args.reg, solver="fast")
    rows = [{"step": i + 1, "seconds": s, "objective": f"{o:.6g}"}
            for i, (s, o) in enumerate(zip(res.step_seconds, res.objective))]
    print(format_table(rows, ["step", "seconds", "objective"]))
    precision, recall = pair_scores(truth, res.assignments)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nJ={args.clients} x {args.components} components, D={args.dim}, reg={args.reg}: "
          f"{res.seconds:.1f} s in all ({len(res.objective)} steps, converged={res.converged}, solver {res.solver})")
    print(f"components: found {res.n_components}, true {n_true} in use; pair precision {precision:.4f}, "
          f"recall {recall:.4f}; peak memory {peak_mb:.0f} MB")
    if args.cvxpy:
        pooled = DiagNormal.concat(posteriors)
        kl = pooled.kl(pooled).T
        costs = np.split(kl / kl.std(), np.cumsum([len(q) for q in posteriors])[:-1])
        t = time.perf_counter()
        P_fast, _ = solve_relaxed(costs, args.reg, solver="fast")
        t_fast = time.perf_counter() - t
        t = time.perf_counter()
        P_cvx, name = solve_relaxed(costs, args.reg, solver="cvxpy")
        t_cvx = time.perf_counter() - t
        of, oc = relaxed_objective(costs, P_fast, args.reg), relaxed_objective(costs, P_cvx, args.reg)
        print(f"first step alone: fast {t_fast:.1f} s (objective {of:.6g}), {name} {t_cvx:.1f} s "
              f"(objective {oc:.6g}); relative gap {(of - oc) / abs(oc):.2e}")


if __name__ == "__main__":
    main()
