"""KL-fusion at the size of a BNN layer: J clients x 150 diagonal-Gaussian components, D = 794.

Usage: python benchmarks/bench_klfusion.py [--clients 5 20 50 100] [--components 150] [--true 300]
       [--dim 794] [--reg 0.1] [--init greedy|pooled] [--cvxpy]

Simulation: ``--true`` global components with means ~ N(0, 1) and variances ~ 0.01 x LogNormal;
each client holds a random subset of ``--components`` of them, each seen as a posterior whose
mean is off the truth by N(0, 0.05^2) and whose variance is the truth's times LogNormal(0, 0.1).

``kl_fuse`` runs with ``solver="fast"`` and ``--init`` ("greedy", the default start, or
"pooled": every local component a global one, G = sum_j L_j). With one value of ``--clients``
it prints each alternation step (seconds, global components, objective); with several, each J
runs in a fresh Python process (so that ``peak MB``, the process's peak resident memory,
inputs included, is that case's own) and one row per J is printed: seconds of ``kl_fuse``,
alternation steps, global components it started from (``start``), components found against the
truth in use, pair precision / recall of the co-assignment (``bayesfuse.metrics.pair_scores``).

With ``--cvxpy`` it also solves the first step's relaxed problem (from the chosen start) with
cvxpy and with the fast solver as ``kl_fuse`` calls it, and prints both objectives and their
relative gap (minutes for J = 5 with ``--init pooled``).
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
from common import simulate_posteriors

from bayesfuse.demo import format_table
from bayesfuse.inference.expfam import DiagNormal, kl_matrix
from bayesfuse.inference.klfusion import greedy_start, kl_fuse
from bayesfuse.inference.relaxed import relaxed_objective, solve_relaxed
from bayesfuse.metrics import pair_scores


def run_case(args, n_clients: int) -> tuple[dict, object]:
    posteriors, truth = simulate_posteriors(n_clients, args.components, args.true, args.dim)
    n_true = len(np.unique(np.concatenate(truth)))
    res = kl_fuse(posteriors, reg=args.reg, solver="fast", init=args.init)
    precision, recall = pair_scores(truth, res.assignments)
    row = dict(
        J=n_clients,
        N=sum(len(q) for q in posteriors),
        seconds=round(res.seconds, 2),
        steps=len(res.objective),
        converged=res.converged,
        start=res.n_initial,
        found=f"{res.n_components}/{n_true}",
        precision=round(precision, 4),
        recall=round(recall, 4),
        peak_MB=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    )
    return row, (posteriors, res)


def first_step_vs_cvxpy(args, posteriors, res) -> None:
    """The first step's relaxed problem, as ``kl_fuse`` builds it, by the fast solver and by cvxpy."""
    pooled = DiagNormal.concat(posteriors)
    sizes = [len(q) for q in posteriors]
    terms = pooled.kl_terms()
    warm = None
    if args.init == "greedy":
        glob, warm = greedy_start(pooled, terms, sizes, args.reg, res.cost_scale)
    else:
        glob = pooled
    costs = np.split(kl_matrix(glob.kl_terms(), terms).T / res.cost_scale, np.cumsum(sizes)[:-1])
    t = time.perf_counter()
    P_fast, _ = solve_relaxed(costs, args.reg, solver="fast", init=warm)
    t_fast = time.perf_counter() - t
    t = time.perf_counter()
    P_cvx, name = solve_relaxed(costs, args.reg, solver="cvxpy")
    t_cvx = time.perf_counter() - t
    of, oc = relaxed_objective(costs, P_fast, args.reg), relaxed_objective(costs, P_cvx, args.reg)
    print(
        f"first step alone ({sum(sizes)} x {len(glob)}): fast {t_fast:.1f} s (objective {of:.6g}), "
        f"{name} {t_cvx:.1f} s (objective {oc:.6g}); relative gap {(of - oc) / abs(oc):.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[5])
    parser.add_argument("--components", type=int, default=150)
    parser.add_argument("--true", type=int, default=300)
    parser.add_argument("--dim", type=int, default=794)
    parser.add_argument("--reg", type=float, default=0.1)
    parser.add_argument("--init", choices=["greedy", "pooled"], default="greedy")
    parser.add_argument("--cvxpy", action="store_true", help="also solve the first step with cvxpy")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one case, one JSON line
    args = parser.parse_args()
    columns = ["J", "N", "seconds", "steps", "converged", "start", "found", "precision", "recall", "peak_MB"]

    if len(args.clients) == 1:
        row, (posteriors, res) = run_case(args, args.clients[0])
        if args.json:
            print(json.dumps(row))
            return
        steps = [
            {"step": i + 1, "seconds": f"{s:.2f}", "objective": f"{o:.6g}"}
            for i, (s, o) in enumerate(zip(res.step_seconds, res.objective))
        ]
        print(format_table(steps, ["step", "seconds", "objective"]))
        print(f"\nD={args.dim}, reg={args.reg}, init={args.init}, solver {res.solver}")
        print(format_table([row], columns))
        if args.cvxpy:
            first_step_vs_cvxpy(args, posteriors, res)
        return

    rows = []
    for n_clients in args.clients:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--clients",
            str(n_clients),
            "--json",
            "--components",
            str(args.components),
            "--true",
            str(args.true),
            "--dim",
            str(args.dim),
            "--reg",
            str(args.reg),
            "--init",
            args.init,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"J={n_clients}: {rows[-1]['seconds']} s", file=sys.stderr, flush=True)
    print(
        f"D={args.dim}, {args.components} components per client of {args.true} true, reg={args.reg}, "
        f"init={args.init}, solver fast"
    )
    print(format_table(rows, columns))


if __name__ == "__main__":
    main()
