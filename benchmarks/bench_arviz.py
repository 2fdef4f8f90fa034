"""Seconds from a fused layer to a reader's first look at it: the ArviZ export, ``az.summary`` and
``az.plot_forest`` on it, and the exact summary and density plot that need no draws.

Usage: python benchmarks/bench_arviz.py [--repeats 3] [--before]

The layer is the README's matching on arrays: 30 IBP-simulated clients, D = 794, gamma0 = 100,
noise variance 0.01, the marginal cost (378 global atoms). Rows, each the best of ``--repeats``
runs after one warm-up (imports, matplotlib's first figure):

* ``to_arviz``         ``res.to_arviz()``, the default export (the first 8 units x first 8
  weights, 2 chains of 100 independent draws; the exact loc/scale of every entry beside them)
* ``az.summary``       ``az.summary(idata)`` at its defaults (every column, diagnostics included)
* ``az.plot_forest``   ``az.plot_forest(idata)`` at its defaults (a line per scalar and chain)
* ``first look``       the three above together: the budget is under 2 s on 2 shared cores
* ``summary (exact)``  ``bayesfuse.analysis.summary(res)``: mean, sd and 94% HDI of all 300,132
  entries from the closed form
* ``plot_posterior``   ``bayesfuse.plot.plot_posterior(res)``: the exact densities of 6 entries

``rows`` is the number of rows of the table (scalars drawn or listed). ``--before`` adds the
export users met before the default was sized for a first look (25 units x 794 weights in one
chain: 19,850 rows; az.summary alone took about 71 s; ``az.plot_forest`` is left out of it).
"""

from __future__ import annotations

import argparse
import time
import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from bayesfuse import plot  # noqa: E402
from bayesfuse.analysis import summary  # noqa: E402
from bayesfuse.demo import format_table  # noqa: E402
from bayesfuse.inference.matching import match_neurons  # noqa: E402
from bayesfuse.models.bbp import simulate_federation  # noqa: E402

BUDGET = 2.0  # seconds for to_arviz + az.summary + az.plot_forest on the default export


def readme_matching():
    """The README's 30-client, D = 794 matching."""
    fed = simulate_federation(30, 794, gamma0=100.0, prior_var=1.0, noise_var=0.01, seed=0)
    return match_neurons(fed.layers, noise_var=0.01, prior_var=1.0, gamma0=100.0, cost="marginal")


def best_of(repeats: int, step) -> tuple[float, object]:
    """The least seconds of ``repeats`` runs of ``step()`` and its last value."""
    best, value = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        value = step()
        best = min(best, time.perf_counter() - start)
        plt.close("all")
    return best, value


def first_look(res, az, repeats: int, **export) -> list[dict]:
    """Rows timing the export of ``res`` with ``export`` options, az.summary and az.plot_forest on it."""
    seconds, idata = best_of(repeats, lambda: res.to_arviz(**export))
    rows = [{"step": "to_arviz", "rows": int(idata.posterior["theta"][0, 0].size), "seconds": seconds}]
    seconds, table = best_of(repeats, lambda: az.summary(idata))
    rows.append({"step": "az.summary", "rows": len(table), "seconds": seconds})
    if not export:
        seconds, _ = best_of(repeats, lambda: az.plot_forest(idata))
        rows.append({"step": "az.plot_forest", "rows": len(table), "seconds": seconds})
    rows.append({"step": "first look", "rows": len(table), "seconds": sum(r["seconds"] for r in rows)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per step; the best is reported")
    parser.add_argument(
        "--before",
        action="store_true",
        help="also time the former default export (25 units x 794 weights, one chain; minutes)",
    )
    args = parser.parse_args()
    with warnings.catch_warnings():  # ArviZ 0.2x announces its 1.x refactor on import
        warnings.simplefilter("ignore", FutureWarning)
        import arviz as az
    res = readme_matching()
    print(f"the README's matching: {res.n_global} global atoms x {res.mean.shape[1]} entries", flush=True)
    first_look(res, az, 1)  # warm-up: ArviZ's and matplotlib's first calls
    rows = [{"export": "default", **row} for row in first_look(res, az, args.repeats)]
    seconds, table = best_of(args.repeats, lambda: summary(res))
    rows.append({"export": "none", "step": "summary (exact)", "rows": len(table), "seconds": seconds})
    seconds, _ = best_of(args.repeats, lambda: plot.plot_posterior(res))
    rows.append({"export": "none", "step": "plot_posterior", "rows": 6, "seconds": seconds})
    if args.before:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows += [{"export": "before", **row} for row in first_look(res, az, 1, units=list(range(25)), chains=1)]
    print(format_table(rows, ["export", "step", "rows", "seconds"]))
    look = next(r["seconds"] for r in rows if r["export"] == "default" and r["step"] == "first look")
    print(
        f"\nfirst look at the default export: {look:.2f} s (budget {BUDGET:.0f} s: "
        f"{'within' if look < BUDGET else 'OVER'})"
    )


if __name__ == "__main__":
    main()
