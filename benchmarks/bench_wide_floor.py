"""What bounds the wide case's time: its assignment solves and cost products, each timed alone.

Usage: python benchmarks/bench_wide_floor.py [--cache DIR] [--data-path DIR]

The wide case of ``bench_scale.py`` (``fuse_files`` with PFNM at its defaults on ten 784-1000-10
Fashion-MNIST MLPs, trained into ``--cache`` if missing) runs once, timed, and once more while
every assignment problem of its matching is recorded (``matching.recording_assignments``): the
(atoms, neurons) matrix ``R`` (what an atom costs a neuron beyond a new atom), its optimum and
its client. Then, per sweep of the alternation (one visit of every client):

* ``assign s``: ``matching.solve_assignment`` on those matrices again, alone (single pairs taken,
  the rest to SciPy's ``linear_sum_assignment``). The solves form a chain: each client's problem
  depends on where the previous client put its units, so they cannot run side by side.
* ``product s``: one float64 product of each problem's shape, (atoms, D) x (D, neurons), alone:
  the least arithmetic an exact cost matrix needs.
* ``cold`` / ``warm``: how much a primal-dual (Hungarian) solver would still have to repair, as
  the number of vertices with a positive dual that a largest matching of tight pairs leaves
  uncovered, started cold (each neuron's dual at its best pair, every atom's at 0) or warm
  (the neurons' optimal duals from the same client's previous problem, each atom's the least
  that keeps the duals feasible). A warm start pays only if it leaves far fewer.

The optimal duals come from :func:`common.optimal_duals`, and each is checked as a certificate
(feasible, and equal in value to the recorded assignment's weight); the largest gap is printed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from common import RESULTS, atom_duals, optimal_duals, wide_models
from scipy.sparse import csr_array
from scipy.sparse.csgraph import maximum_bipartite_matching

from bayesfuse.demo import format_table
from bayesfuse.fuse_files import fuse_files
from bayesfuse.inference.matching import recording_assignments, solve_assignment

GOAL_SECONDS = 5.0


def _uncovered(W: np.ndarray, u: np.ndarray, w: np.ndarray) -> int:
    """Vertices with a positive dual that a largest matching of tight positive pairs leaves uncovered."""
    tight = (W > 0) & (np.abs(u[None, :] + w[:, None] - W) <= 1e-9 * (1.0 + W))
    atom_to_neuron = maximum_bipartite_matching(csr_array(tight), perm_type="column")
    covered = np.zeros(W.shape[1], dtype=bool)
    covered[atom_to_neuron[atom_to_neuron >= 0]] = True
    return int(np.sum((u > 1e-12) & ~covered) + np.sum((w > 1e-12) & (atom_to_neuron < 0)))


def _record(files: list[Path], folder: Path) -> list[dict]:
    """Fuse ``files`` at the defaults, saving every assignment problem's ``R`` and optimum in ``folder``."""
    problems, clients = [], {}

    def record(v, R, assignment, steps):
        client = clients.setdefault(np.asarray(v[0]).tobytes(), len(clients))
        sweep = sum(p["client"] == client for p in problems)
        path = folder / f"problem{len(problems)}.npy"
        np.save(path, R)
        np.save(path.with_suffix(".match.npy"), assignment)
        problems.append(dict(client=client, sweep=sweep, dim=v.shape[1], path=path, steps=steps))

    with recording_assignments(record):
        _fuse(files, folder)
    return problems


def _fuse(files: list[Path], folder: Path) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        fuse_files(files, "pfnm", folder / "fused.pt", force=True)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", default=None, help="Fashion-MNIST IDX directory (default: the Debian one)")
    parser.add_argument("--cache", default=str(RESULTS / "wide-mlps"), help="where the trained wide MLPs are kept")
    args = parser.parse_args()
    files = wide_models(Path(args.cache), args.data_path)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        whole = _fuse(files, folder)
        problems = _record(files, folder)
        duals, rows, worst_gap = {}, {}, 0.0
        for p in problems:
            R, match = np.load(p["path"]), np.load(p["path"].with_suffix(".match.npy"))
            G, L = R.shape
            start = time.perf_counter()
            solve_assignment(R, p["steps"])
            assign_s = time.perf_counter() - start
            h, v = rng.normal(size=(G, p["dim"])), rng.normal(size=(L, p["dim"]))
            start = time.perf_counter()
            h @ v.T
            product_s = time.perf_counter() - start
            W = np.maximum(-R, 0.0)
            u, w = optimal_duals(W, match)
            value = W[match[match >= 0], np.flatnonzero(match >= 0)].sum()
            if np.any(u[None, :] + w[:, None] < W - 1e-9 * (1.0 + W)):
                raise AssertionError("the duals are not feasible")
            worst_gap = max(worst_gap, (u.sum() + w.sum() - value) / max(value, 1.0))
            cold = _uncovered(W, W.max(axis=0), np.zeros(G))
            previous = duals.get(p["client"])
            warm = None if previous is None else _uncovered(W, previous, atom_duals(W, previous))
            duals[p["client"]] = u
            row = rows.setdefault(
                p["sweep"], dict(solves=0, atoms=[], candidates=[], assign=0.0, product=0.0, cold=[], warm=[])
            )
            row["solves"] += 1
            row["atoms"].append(G)
            row["candidates"].append(float(np.mean(R < 0)))
            row["assign"] += assign_s
            row["product"] += product_s
            row["cold"].append(cold)
            if warm is not None:
                row["warm"].append(warm)
    table = [
        dict(
            sweep=str(k + 1),
            solves=r["solves"],
            atoms=f"{min(r['atoms'])}-{max(r['atoms'])}",
            candidates=f"{np.mean(r['candidates']):.0%}",
            **{
                "assign s": f"{r['assign']:.2f}",
                "product s": f"{r['product']:.2f}",
                "cold": f"{np.mean(r['cold']):.0f}",
                "warm": f"{np.mean(r['warm']):.0f}" if r["warm"] else "-",
            },
        )
        for k, r in sorted(rows.items())
    ]
    assign_total = sum(r["assign"] for r in rows.values())
    product_total = sum(r["product"] for r in rows.values())
    table.append(
        {
            "sweep": "all",
            "solves": len(problems),
            "atoms": "",
            "candidates": "",
            "assign s": f"{assign_total:.2f}",
            "product s": f"{product_total:.2f}",
            "cold": "",
            "warm": "",
        }
    )
    print(
        f"10 x 784-1000-10 (pfnm, defaults): {whole:.1f} s in full, {len(problems)} assignment problems, "
        f"{len({p['client'] for p in problems})} clients"
    )
    print(format_table(table, ["sweep", "solves", "atoms", "candidates", "assign s", "product s", "cold", "warm"]))
    print(f"largest relative duality gap of the certificates: {worst_gap:.1e}")
    print(
        f"assignment chain alone {assign_total:.1f} s + products alone {product_total:.1f} s = "
        f"{assign_total + product_total:.1f} s, against the goal of {GOAL_SECONDS:g} s for the whole fusion"
    )


if __name__ == "__main__":
    main()
