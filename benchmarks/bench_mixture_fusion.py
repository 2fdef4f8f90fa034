"""Fusing Gaussian-mixture posteriors (KL-fusion paper, section 5.1, Figures 2 and 3).

Usage: python benchmarks/bench_mixture_fusion.py [--seeds 0 1] [--out bench-results]

A global mixture of K = 8 components in 2-D (elongated covariances); 10 clients each hold data
from 4 random components whose means are moved by N(0, noise^2). Each client fits a
variational Dirichlet-process mixture (Normal-Wishart factors). Methods:

* ``kl-fusion``: :func:`kl_fuse` on the Normal-Wishart posteriors (reg 0.1, costs / std);
* ``spahm``: the BBP matching engine on the local posterior means only (exact marginal cost,
  given the generating noise and separation: a favourable setting for it);
* ``oracle``: variational mixture on the pooled data with the true K (not a fusion method).

Scores: Hausdorff distance between the polytopes spanned by true and estimated means, and the
error |G - K| in the number of components. Experiment 1 varies the separation of the means
(sd of the means' distribution) at noise 0.05; experiment 2 varies the noise at separation 0.5.
Writes ``mixture_fusion.png`` and prints both tables.
"""

from __future__ import annotations

import argparse
import io
import warnings
from pathlib import Path

import numpy as np
from common import RESULTS, write_bytes

from bayesfuse.demo import format_table
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.matching import match_neurons
from bayesfuse.models.mixture import fit_local_posterior, hausdorff_polytopes, simulate_mixture_federation

K, PER_CLIENT = 8, 4


def run_one(separation: float, noise: float, seed: int) -> dict[str, tuple[float, int]]:
    fed = simulate_mixture_federation(
        n_components=K, components_per_client=PER_CLIENT, separation=separation, noise=noise, seed=seed
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*did not converge.*")
        posts = [fit_local_posterior(x, seed=seed) for x in fed.datasets]
        oracle = fit_local_posterior(np.vstack(fed.datasets), max_components=K, finite=True, seed=seed)
    fused = kl_fuse(posts, reg=0.1)
    spahm = match_neurons(
        [p.mean for p in posts],
        noise_var=noise**2 + 0.01,
        prior_var=separation**2,
        gamma0=PER_CLIENT,
        cost="marginal",
        seed=seed,
    )
    out = {}
    for name, means in (("kl-fusion", fused.components.mean), ("spahm", spahm.mean), ("oracle", oracle.mean)):
        out[name] = (hausdorff_polytopes(fed.means, means), abs(len(means) - K))
    return out


def sweep(values, key, fixed, seeds):
    rows = []
    for v in values:
        kwargs = {key: v, **fixed}
        runs = [run_one(kwargs["separation"], kwargs["noise"], s) for s in seeds]
        row = {key: v}
        for m in ("kl-fusion", "spahm", "oracle"):
            row[f"{m} hausdorff"] = float(np.mean([r[m][0] for r in runs]))
            row[f"{m} |G-K|"] = float(np.mean([r[m][1] for r in runs]))
        rows.append(row)
        print(format_table([row], list(row)).splitlines()[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    print("experiment 1: separation of the means (noise 0.05)")
    sep_rows = sweep([0.15, 0.25, 0.5, 1.0, 2.0], "separation", {"noise": 0.05}, args.seeds)
    print("experiment 2: noise on the local means (separation 0.5)")
    noise_rows = sweep([0.0, 0.05, 0.1, 0.2, 0.4], "noise", {"separation": 0.5}, args.seeds)
    for title, rows in (("separation", sep_rows), ("noise", noise_rows)):
        print(f"\n{title} (mean over seeds {args.seeds})")
        print(format_table(rows, list(rows[0])))

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    for col, (key, rows) in enumerate((("separation", sep_rows), ("noise", noise_rows))):
        x = [r[key] for r in rows]
        for m, style in (("kl-fusion", "o-"), ("spahm", "s--"), ("oracle", "^:")):
            axes[0, col].plot(x, [r[f"{m} hausdorff"] for r in rows], style, label=m)
            axes[1, col].plot(x, [r[f"{m} |G-K|"] for r in rows], style, label=m)
        axes[0, col].set_ylabel("Hausdorff distance")
        axes[1, col].set_ylabel("|G - K|")
        axes[1, col].set_xlabel(key)
        if key == "separation":
            for ax in axes[:, col]:
                ax.set_xscale("log")
                ax.set_xticks(x, [f"{v:g}" for v in x])
                ax.minorticks_off()
    axes[0, 0].legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    path = write_bytes(Path(args.out) / "mixture_fusion.png", buf.getvalue())
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
