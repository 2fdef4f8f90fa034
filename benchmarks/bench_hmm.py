"""HMM states fused across smartwatch sessions (KL-fusion paper, section 5.2, Table 1).

Usage: python benchmarks/bench_hmm.py [--seeds 0 1 2] [--states 6] [--quick] [--out bench-results]

Data: UEA BasicMotions (aeon's wheel, ``make data``): 80 recordings of 10 s, 6 channels
(accelerometer, gyroscope), four activities. Each client is a session of recordings of 3 of the 4
activities strung together (:func:`motion_sessions`, channels through ``arcsinh``). Each client
fits a sticky Bayesian HMM with ``--states`` states and Normal-Wishart emission posteriors
(hmmlearn's VariationalGaussianHMM); states used for under 2% of the steps are dropped. Methods:

* ``kl-fusion``: :func:`kl_fuse` on the Normal-Wishart posteriors (eq. 9, reg 0.1, the paper's);
* ``spahm``: the BBP matching engine on the states' posterior means only (cost="marginal");
* ``local``: no fusion, each client's states kept apart (the global labels are client x state).

Scores: Rand index and adjusted mutual information of all steps' global states against the true
activities, mean +- sd over the seeds (each seed draws other sessions and fits).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np
from common import RESULTS, json_default, write_text

from bayesfuse.data.motion import load_basic_motions, motion_sessions
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.models.hmm import fit_local_hmm, relabel, segmentation_scores, spahm_fuse


def run_seed(data, seed: int, args) -> dict:
    sessions = motion_sessions(data, n_clients=args.clients, recordings_per_activity=args.recordings, seed=seed)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = [fit_local_hmm(x, args.states, n_iter=args.iters, seed=seed) for x in sessions.sequences]
    t_local = time.perf_counter() - t0
    labels = [m.labels for m in local]
    posts = [m.states for m in local]
    out = {"seconds": {"local fits": t_local}, "states": {}, "scores": {}}
    for reg in args.regs:
        res = kl_fuse(posts, reg=reg)
        name = f"kl-fusion reg {reg:g}"
        out["scores"][name] = segmentation_scores(sessions.activities, relabel(labels, res.assignments))
        out["states"][name] = res.n_global
        out["seconds"][name] = res.seconds
    t0 = time.perf_counter()
    spahm = spahm_fuse(posts, seed=seed)
    out["seconds"]["spahm"] = time.perf_counter() - t0
    out["scores"]["spahm"] = segmentation_scores(sessions.activities, relabel(labels, spahm.assignments))
    out["states"]["spahm"] = spahm.n_global
    offsets = np.cumsum([0] + [len(p) for p in posts])
    apart = [np.arange(len(p)) + o for p, o in zip(posts, offsets)]
    out["scores"]["local"] = segmentation_scores(sessions.activities, relabel(labels, apart))
    out["states"]["local"] = int(offsets[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--recordings", type=int, default=3, help="recordings per activity per client")
    parser.add_argument("--states", type=int, default=6)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--regs", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 3 clients, 2 recordings per activity")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.clients, args.recordings, args.iters = [0], 3, 2, 50
    try:
        data = load_basic_motions()
    except FileNotFoundError as err:  # the data come from `make data`; say so and skip
        print(f"skipped: {err}")
        return
    runs = []
    for s in args.seeds:
        t0 = time.perf_counter()
        runs.append(run_seed(data, s, args))
        print(f"seed {s}: {time.perf_counter() - t0:.0f} s", flush=True)
    methods = list(runs[0]["scores"])
    lines = [
        f"BasicMotions: {args.clients} sessions of 3 of 4 activities x {args.recordings} recordings, "
        f"{args.states} local states, seeds {args.seeds}",
        "",
        f"{'method':<20} {'Rand index':>16} {'AMI':>16} {'states':>7}",
    ]
    for m in methods:
        r = [x["scores"][m]["rand"] for x in runs]
        a = [x["scores"][m]["ami"] for x in runs]
        lines.append(
            f"{m:<20} {np.mean(r):>8.3f} +- {np.std(r):.3f} {np.mean(a):>8.3f} +- {np.std(a):.3f} "
            f"{np.mean([x['states'][m] for x in runs]):>7.1f}"
        )
    secs = {k: float(np.mean([r["seconds"][k] for r in runs])) for k in runs[0]["seconds"]}
    lines += ["", "seconds (mean over seeds): " + ", ".join(f"{k} {v:.2f}" for k, v in secs.items())]
    text = "\n".join(lines)
    print("\n" + text)
    name = "hmm_quick" if args.quick else "hmm"
    write_text(Path(args.out) / f"{name}.txt", text + "\n")
    write_text(Path(args.out) / f"{name}.json", json.dumps(runs, default=json_default, indent=1))


if __name__ == "__main__":
    main()
