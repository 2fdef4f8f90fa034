"""Fusing horseshoe BNNs against the ensemble of their parts and a pooled BNN (KL-fusion section 5.4).

Usage: python benchmarks/bench_bnn_fusion.py [--dataset digits|fashion-mnist] [--clients 5]
       [--alpha 0.8] [--hidden 150 [H2 ...]] [--epochs N] [--train-size N] [--seeds 0 1 2]
       [--regs 0.001 0.003 0.01 0.03 0.1] [--samples S] [--cache DIR] [--out bench-results]
       python benchmarks/bench_bnn_fusion.py --speed [--dataset fashion-mnist]

Per seed: a validation set (10% of the training set) is held out, the rest is split over the
clients with a Dirichlet(alpha) class skew, and one horseshoe BNN is trained per client and
one on the clients' data pooled (the upper bound a federation cannot reach). Reported on the
test set: accuracy, log-likelihood, ECE, the AUROC of predictive entropy for telling test
images from font-rendered digits (out of distribution), and the hidden units of

* each local BNN, and their **ensemble** (predictive average, ``5 x H`` units);
* the **pooled** BNN;
* the ensemble **tempered** (:mod:`bayesfuse.calibration`: ``softmax(log p / T)``) by the one
  temperature that maximises its validation log-likelihood: the ensemble at its best
  calibration, since averaging clients that disagree leaves it under-confident;
* the same ensemble with each client weighted per class by its share of that class's training
  examples (``sum_j s_jk p_j(k | x)``, normalised): the rule of the client heads below;
* the **fused** BNN by KL-fusion, with ``reg`` chosen per seed from ``--regs`` by validation
  log-likelihood (never the test set), and by NAFI at its defaults;
* the fused BNN (KL-fusion, the same ``reg``) with **client heads** (``head="clients"``,
  :mod:`bayesfuse.models.bnn_heads`): the fused hidden units, each client's output layer on
  them, their softmaxes mixed by class shares; and the same heads pooled geometrically
  (``predict(x, pool="log")``: ``prod_j p_j(k | x)^(s_jk)``, normalised), next to the locals
  pooled the same way;
* the fused BNN (KL-fusion, the same ``reg``), with and without client heads, whose units were
  pruned by what they contribute on each client's own data (``+summaries``: each client sends
  :func:`bayesfuse.summarize` of its BNN, its units' activation moments; ``prune_share``)
  instead of by their information (the data-free rule, which reads how far each guide has
  converged);
* the fused BNNs without pruning and with the raw unit form (the two ablations of
  :func:`bayesfuse.core._fuse_bnn_states`);
* the locals **side by side** in one network (KL-fusion with ``reg`` 1e-12, at which no unit
  merges, and no pruning): its logits are the class-share average of the locals' logits, the
  rule by which the fused BNN combines the clients, with nothing merged or dropped. Between the
  ensemble and it lies what one softmax over averaged logits gives up against averaged
  probabilities, whatever the fusion does;
* the **ensemble of the pruned locals**: each local BNN with the units pruning drops removed
  (a one-client fusion), predictions averaged. It holds the units the fused BNN is built
  from, so between it and the fused BNN lies what one network loses against averaging
  predictive distributions (the fused logits are a class-share average of the clients'), and
  between it and the ensemble what pruning loses.

``--hidden 150 100`` trains and fuses BNNs of two hidden layers (layer by layer,
:mod:`bayesfuse.models.bnn_fusion`); ``units`` then counts the units of every hidden layer.

Prints one table per seed, a summary (mean +- sd over seeds), and the fused models minus the
ensemble and above the best local (mean +- sd over seeds, and on how many seeds each is at or
above the ensemble, or 3 points above the best local); writes ``bnn_fusion_<dataset>.json``
and ``bnn_fusion_<dataset>.png`` (``bnn_fusion_<dataset>_<L>layers.*`` for L > 1 hidden layers)
(entropy per class on font digits, Figure 5; test images sorted by the fused BNN's entropy,
Figure 1).

``--speed`` times local training of the largest client of each seed with the ELBO estimators
of :func:`bayesfuse.models.bnn.train_bnn` (``local``, ``pyro``), and Pyro's ``AutoNormal``
guide on the same model as a reference point: examples per second (of the median epoch), and
the test accuracy and log-likelihood each estimator reaches, per seed and paired.
"""

from __future__ import annotations

import argparse
import io
import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, cached_models, json_default, write_bytes
from scipy.special import softmax

from bayesfuse import fuse, summarize
from bayesfuse.calibration import fit_temperature, tempered
from bayesfuse.data import dirichlet_partition, load_dataset, load_font_digits
from bayesfuse.demo import format_table
from bayesfuse.metrics import accuracy, evaluate, negative_log_likelihood, ood_auroc, predictive_entropy
from bayesfuse.models.bnn import BNNConfig, HorseshoeBNN, train_bnn
from bayesfuse.models.bnn_fusion import output_shares

COLUMNS = ("model", "accuracy", "loglik", "elpd", "elpd_se", "ece", "auroc", "units")


SIDE_BY_SIDE = "locals side by side"
HEADS = "fused (kl), client heads"
HEADS_LOG = "fused (kl), client heads, log pool"
#: The fused BNNs whose units were pruned by what they contribute on each client's data (its summary).
SUMMARIES = "fused (kl) +summaries"
HEADS_SUMMARIES = "fused (kl), client heads +summaries"
SHARE_ENSEMBLE = "ensemble, class-share weights"
SHARE_LOG_ENSEMBLE = "ensemble, class-share log pool"
TEMPERED_ENSEMBLE = "ensemble, temperature on validation"


def _share_mixture(probs: list[np.ndarray], shares: np.ndarray) -> np.ndarray:
    """``sum_j s_jk p_j(k | x)``, normalised over k: the locals mixed as the client heads are."""
    q = np.einsum("jk,jnk->nk", shares, np.asarray(probs))
    return q / q.sum(1, keepdims=True)


def _share_log_pool(probs: list[np.ndarray], shares: np.ndarray) -> np.ndarray:
    """``prod_j p_j(k | x)^(s_jk)``, normalised over k: the locals pooled as ``pool="log"`` pools the heads."""
    logp = np.log(np.clip(np.asarray(probs), np.finfo(float).tiny, None))
    return softmax(np.einsum("jk,jnk->nk", shares, logp), axis=1)


def scores(p, y, h_ood=None) -> dict:
    """Accuracy, mean log-likelihood, ECE; the held-out elpd ``sum_i log p(y_i | x_i)`` over the test
    set with its standard error ``sqrt(n var_i)`` (Vehtari et al. 2017, eq. 23, for held-out
    points); with ``h_ood`` the entropy AUROC."""
    m = evaluate(p, y)
    lpd = np.log(np.clip(np.asarray(p)[np.arange(len(y)), y], 1e-300, None))
    out = {
        "accuracy": m["accuracy"],
        "loglik": -m["nll"],
        "elpd": float(lpd.sum()),
        "elpd_se": float(np.sqrt(len(lpd) * lpd.var())),
        "ece": m["ece"],
    }
    if h_ood is not None:
        out["auroc"] = ood_auroc(predictive_entropy(p), h_ood)
    return out


def _trained(cache: Path | None, name: str, x, y, n_classes, hidden, config) -> HorseshoeBNN:
    """A horseshoe BNN trained on ``(x, y)``, kept in ``cache`` (when given) as ``name.pt``."""
    files = None if cache is None else [cache / f"{name}.pt"]
    return cached_models(
        files, lambda: [train_bnn(x, y, n_classes, hidden, config, name=name)], load=HorseshoeBNN.from_state_dict
    )[0]


def run_seed(args, seed: int) -> dict:
    split = load_dataset(args.dataset, seed=seed).standardize()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(split.train))
    n_val = len(order) // 10
    rest = order[n_val:] if args.train_size is None else order[n_val : n_val + args.train_size]
    val, train = split.train.subset(order[:n_val]), split.train.subset(rest)
    fonts = load_font_digits(split.train.image_shape[0], seed=seed)
    x_ood = split.standardizer.transform(fonts.x)
    part = dirichlet_partition(train.y, args.clients, args.alpha, seed=seed)
    epochs = args.epochs or (200 if args.dataset == "digits" else 30)
    hidden = _hidden(args)
    shape = "x".join(map(str, args.hidden))
    size = "" if args.train_size is None else f"_n{args.train_size}"
    cache = Path(args.cache) / f"{args.dataset}_h{shape}_e{epochs}{size}_s{seed}" if args.cache else None
    print(
        f"seed {seed}: {args.clients} clients (Dirichlet {args.alpha}), sizes {part.sizes.tolist()}, "
        f"{shape}-unit horseshoe BNNs, {epochs} epochs, validation {n_val}",
        flush=True,
    )
    units = sum(args.hidden)

    def predict(model, x):
        return model.predict(x, args.samples, seed=seed)

    def scored(name, p, p_ood, units, seconds=None, extra=None):
        """The row of a model with test probabilities ``p`` and out-of-distribution ones ``p_ood``."""
        h_ood = predictive_entropy(p_ood)
        row = {"model": name, **scores(p, split.test.y, h_ood), "units": units, "seconds": seconds, **(extra or {})}
        print("  " + format_table([row], COLUMNS).splitlines()[-1], flush=True)
        entropies[name] = (predictive_entropy(p), h_ood)
        return row

    def evaluate(name, model, units, seconds, extra=None):
        p, p_ood = predict(model, split.test.x), predict(model, x_ood)
        return scored(name, p, p_ood, units, seconds, extra), p, p_ood

    def ensemble(name, members, units):
        """The predictive average of ``members``' (test, out-of-distribution) probabilities."""
        return scored(name, *(np.mean([m[i] for m in members], axis=0) for i in (0, 1)), units)

    rows, entropies = [], {}
    local_probs = []
    bnns = []
    for j, idx in enumerate(part):
        bnn = _trained(
            cache,
            f"local{j}",
            train.x[idx],
            train.y[idx],
            split.n_classes,
            hidden,
            BNNConfig(epochs=epochs, seed=seed * 100 + j),
        )
        bnns.append(bnn)
        row, *pair = evaluate(f"local {j}", bnn, units, getattr(bnn, "train_seconds", None))
        rows.append(row)
        local_probs.append(pair)
    rows.append(ensemble("ensemble", local_probs, args.clients * units))
    shares = output_shares(part.counts, args.clients, split.n_classes)
    rows.append(
        scored(
            SHARE_ENSEMBLE, *(_share_mixture([m[i] for m in local_probs], shares) for i in (0, 1)), args.clients * units
        )
    )
    rows.append(
        scored(
            SHARE_LOG_ENSEMBLE,
            *(_share_log_pool([m[i] for m in local_probs], shares) for i in (0, 1)),
            args.clients * units,
        )
    )
    # the ensemble calibrated by one temperature fitted on the validation split
    temperature = fit_temperature(np.mean([predict(b, val.x) for b in bnns], axis=0), val.y)
    rows.append(
        scored(
            TEMPERED_ENSEMBLE,
            *(tempered(np.mean([m[i] for m in local_probs], axis=0), temperature) for i in (0, 1)),
            args.clients * units,
            extra={"temperature": temperature},
        )
    )
    pooled_idx = np.concatenate(list(part))
    pooled = _trained(
        cache,
        "pooled",
        train.x[pooled_idx],
        train.y[pooled_idx],
        split.n_classes,
        hidden,
        BNNConfig(epochs=epochs, seed=seed * 100 + 99),
    )
    rows.append(evaluate("pooled (upper bound)", pooled, units, getattr(pooled, "train_seconds", None))[0])

    # reg by validation log-likelihood
    validation = []
    for reg in args.regs:
        res = fuse(bnns, "kl", class_counts=part.counts, reg=reg)
        v = scores(predict(res.model, val.x), val.y)
        validation.append({"reg": reg, "units": sum(res.sizes), "layers": res.sizes, **v})
        print(
            f"  validation: reg {reg:g}: {_sizes(res.sizes)} units, accuracy {v['accuracy']:.4f}, "
            f"loglik {v['loglik']:.4f}",
            flush=True,
        )
    best = max(validation, key=lambda r: r["loglik"])["reg"]
    # each client's summary of its own data: its units' moments (bayesfuse.summarize)
    summaries = [summarize(bnn, train.x[idx], train.y[idx]) for bnn, idx in zip(bnns, part)]
    fused = {}
    for name, method, hyper in (
        ("fused (kl)", "kl", dict(reg=best)),
        (HEADS, "kl", dict(reg=best, head="clients")),
        (SUMMARIES, "kl", dict(reg=best, summaries=summaries)),
        (HEADS_SUMMARIES, "kl", dict(reg=best, head="clients", summaries=summaries)),
        ("fused (nafi)", "nafi", {}),
        ("kl, no pruning", "kl", dict(reg=best, prune_kl=0.0)),
        ("kl, raw units", "kl", dict(reg=best, unit_form="raw")),
        # reg far below any KL cost: no unit merges, none is pruned
        (SIDE_BY_SIDE, "kl", dict(reg=1e-12, prune_kl=0.0)),
    ):
        res = fuse(bnns, method, class_counts=part.counts, **hyper)
        fused[name] = res
        rows.append(
            evaluate(name, res.model, sum(res.sizes), res.seconds, {"hyper": res.hyper, "layers": res.sizes})[0]
        )
        if name in (SUMMARIES, HEADS_SUMMARIES):
            rows[-1]["summary_bytes"] = float(np.mean([x.nbytes for x in summaries]))
        if name == HEADS:  # the same heads, pooled geometrically
            log_pool = [res.model.predict(x, args.samples, seed=seed, pool="log") for x in (split.test.x, x_ood)]
            rows.append(scored(HEADS_LOG, *log_pool, sum(res.sizes), res.seconds, {"layers": res.sizes}))
    with warnings.catch_warnings():  # one model per fusion on purpose: it comes back pruned
        warnings.filterwarnings("ignore", "only one model", UserWarning)
        pruned = [fuse([bnn], "kl", reg=best) for bnn in bnns]
    rows.append(
        ensemble(
            "ensemble, pruned locals",
            [(predict(r.model, split.test.x), predict(r.model, x_ood)) for r in pruned],
            sum(sum(r.sizes) for r in pruned),
        )
    )

    def count(kept):
        return [len(k) for k in kept] if len(args.hidden) == 1 else [[len(k) for k in layer] for layer in kept]

    kept = count(fused["fused (kl)"].hyper["kept_units"])
    kept_summaries = count(fused[SUMMARIES].hyper["kept_units"])
    print(f"  units kept per client: {kept} (information, data-free), {kept_summaries} (function, summaries)")
    return {
        "units_kept_summaries": kept_summaries,
        "seed": seed,
        "rows": rows,
        "validation": validation,
        "reg": best,
        "sizes": part.sizes.tolist(),
        "units_kept": kept,
        "entropies": entropies,
        "split": split,
        "fonts": fonts,
        "fused": fused["fused (kl)"].model,
    }


def _over_seeds(row: dict, key: str, values) -> np.ndarray:
    """Put the mean of ``values`` (one per seed) in ``row[key]`` and their sd in ``row[key + "_sd"]``."""
    values = np.asarray(values, dtype=float)
    row[key] = float(values.mean())
    row[key + "_sd"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    return values


def summary(runs: list[dict]) -> list[dict]:
    out = []
    for i, first in enumerate(runs[0]["rows"]):
        row = {"model": first["model"]}
        for c in COLUMNS[1:]:
            _over_seeds(row, c, [r["rows"][i].get(c, np.nan) for r in runs])
        out.append(row)
    return out


def _shown(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        c = {"model": r["model"]}
        for k in COLUMNS[1:]:
            c[k] = f"{r[k]:.4f} ± {r[k + '_sd']:.4f}" if k != "units" else f"{r[k]:.0f} ± {r[k + '_sd']:.0f}"
        cells.append(c)
    return format_table(cells, COLUMNS)


def speed(args) -> None:
    """Examples per second of local training per ELBO estimator, and the test accuracy and
    log-likelihood each reaches, on the largest client of each seed; Pyro's AutoNormal guide on
    the same model (seed 0, a few epochs) as a reference point for the speed."""
    rows, first = [], None
    for seed in args.seeds:
        split = load_dataset(args.dataset, seed=seed).standardize()
        part = dirichlet_partition(split.train.y, args.clients, args.alpha, seed=seed)
        idx = max(part, key=len)
        x, y = split.train.x[idx], split.train.y[idx]
        first = first or (x, y, split.n_classes)
        epochs = args.epochs or (200 if args.dataset == "digits" else 30)
        print(
            f"{args.dataset}, seed {seed}: client with {len(idx)} examples, {args.hidden} units, {epochs} epochs, "
            f"1 thread",
            flush=True,
        )
        for estimator in ("local", "pyro"):
            # a short run first, so that one-time costs (first calls, allocations) are not timed
            train_bnn(x[:256], y[:256], split.n_classes, _hidden(args), BNNConfig(epochs=1, estimator=estimator))
            bnn = train_bnn(
                x, y, split.n_classes, _hidden(args), BNNConfig(epochs=epochs, estimator=estimator, seed=seed)
            )
            p = bnn.predict(split.test.x, args.samples, seed=seed)
            # the median epoch: other work on a shared machine slows some epochs, and not both runs alike
            rows.append(
                {
                    "seed": seed,
                    "training": f"HorseshoeBNN, estimator={estimator!r}",
                    "examples/s": len(x) / float(np.median(bnn.epoch_seconds)),
                    "accuracy": accuracy(p, split.test.y),
                    "loglik": -negative_log_likelihood(p, split.test.y),
                }
            )
            print(format_table(rows[-1:], list(rows[0])).splitlines()[-1], flush=True)
    rate = _autonormal_rate(*first, _hidden(args))
    rows.append(
        {
            "seed": args.seeds[0],
            "training": "AutoNormal guide (3 epochs timed)",
            "examples/s": rate,
            "accuracy": float("nan"),
            "loglik": float("nan"),
        }
    )
    print()
    print(format_table(rows, list(rows[0])))
    local = [r for r in rows if r["training"].endswith("'local'")]
    pyro_ = [r for r in rows if r["training"].endswith("'pyro'")]
    ratio = np.array([a["examples/s"] / b["examples/s"] for a, b in zip(local, pyro_)])
    d_acc = np.array([100 * (a["accuracy"] - b["accuracy"]) for a, b in zip(local, pyro_)])
    d_ll = np.array([a["loglik"] - b["loglik"] for a, b in zip(local, pyro_)])
    print(
        f"estimator='local' over 'pyro', per seed: speed-up {', '.join(f'{r:.2f}x' for r in ratio)}; "
        f"accuracy {', '.join(f'{d:+.1f}' for d in d_acc)} points; loglik {', '.join(f'{d:+.3f}' for d in d_ll)}"
    )
    print(f"estimator='local' over AutoNormal (seed {args.seeds[0]}): {local[0]['examples/s'] / rate:.2f}x")


def _autonormal_rate(x: np.ndarray, y: np.ndarray, n_classes: int, hidden, n_epochs: int = 3) -> float:
    """Examples per second (median epoch of ``n_epochs``) of Pyro's ``Trace_ELBO`` with an
    ``AutoNormal`` guide on the same horseshoe BNN (float64, batches of 128, one thread) on ``(x, y)``."""
    import pyro
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    torch.set_num_threads(1)
    pyro.clear_param_store()
    model = HorseshoeBNN(x.shape[1], hidden, n_classes)
    guide = AutoNormal(model.model)
    svi = SVI(model.model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    xt, yt = torch.from_numpy(np.asarray(x, dtype=np.float64)), torch.from_numpy(y.astype(np.int64))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # AutoNormal creates its parameters in the default dtype
    try:
        with pyro.validation_enabled(False):
            seconds = []
            for _ in range(n_epochs):
                start = time.perf_counter()
                order = torch.randperm(len(xt))
                for i in range(0, len(xt), 128):
                    b = order[i : i + 128]
                    svi.step(xt[b], yt[b], len(xt))
                seconds.append(time.perf_counter() - start)
            return len(xt) / float(np.median(seconds))
    finally:
        torch.set_default_dtype(default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[150],
        help="units per hidden layer (two numbers: a BNN of two hidden layers)",
    )
    parser.add_argument("--epochs", type=int, default=None, help="default: 200 (digits), 30 (fashion-mnist)")
    parser.add_argument(
        "--train-size",
        type=int,
        default=None,
        help="split only this many training examples over the clients (small clients); default: all but the validation",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--regs",
        type=float,
        nargs="+",
        default=[0.001, 0.003, 0.01, 0.03, 0.1],
        help="KL-fusion reg values to choose from by validation log-likelihood",
    )
    parser.add_argument("--samples", type=int, default=100, help="Monte Carlo samples of the predictive")
    parser.add_argument("--cache", default=None, help="directory to keep trained BNNs in between runs")
    parser.add_argument("--speed", action="store_true", help="time local training per ELBO estimator instead")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.speed:
        speed(args)
        return
    start = time.perf_counter()
    runs = [run_seed(args, seed) for seed in args.seeds]
    for run in runs:
        print(
            f"\nseed {run['seed']} (reg {run['reg']:g} by validation; units kept per client {run['units_kept']}, "
            f"with summaries {run['units_kept_summaries']})"
        )
        print(format_table(run["rows"], COLUMNS))
        print(_against(run["rows"]))
    rows = summary(runs)
    print(f"\n{args.dataset}, {args.clients} clients, Dirichlet({args.alpha}), seeds {args.seeds}: mean ± sd")
    print(_shown(rows))
    against = gains(runs)
    print(
        "\nminus the ensemble (accuracy, loglik, auroc) and points above the best local, mean ± sd over "
        "seeds (seeds at or above the ensemble; for points, at least 3 above the best local)"
    )
    print(_shown_gains(against, len(runs)))
    print(f"whole study: {time.perf_counter() - start:.0f} s")
    out = Path(args.out)
    report = {
        "config": vars(args),
        "summary": rows,
        "against_ensemble": against,
        "seeds": [
            {k: r[k] for k in ("seed", "rows", "validation", "reg", "sizes", "units_kept", "units_kept_summaries")}
            for r in runs
        ],
    }
    write_bytes(
        out / f"bnn_fusion_{_tag(args)}.json",
        json.dumps(report, indent=1, allow_nan=False, default=json_default).encode(),
    )
    print(f"wrote {_figure(args, runs[0])}")


def _figure(args, run):
    import matplotlib

    matplotlib.use("Agg")
    from bayesfuse.plot import plot_centred_entropy, plot_sorted_images

    split, fonts = run["split"], run["fonts"]
    fig = matplotlib.pyplot.figure(figsize=(12, 7.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1.2, 1])
    ax = top.subplots()
    shown = {
        k: v for k, v in run["entropies"].items() if k.startswith("local ") or k in ("ensemble", "fused (kl)", HEADS)
    }
    plot_centred_entropy(shown, fonts.y, ax=ax)
    ax.set_title(f"{args.dataset}, seed {run['seed']}: uncertainty on out-of-distribution font digits (Figure 5)")
    h = run["entropies"]["fused (kl)"][0]
    raw = split.standardizer.scale * split.test.x + split.standardizer.mean
    plot_sorted_images(raw, h, split.test.image_shape, fig=bottom)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return write_bytes(Path(args.out) / f"bnn_fusion_{_tag(args)}.png", buf.getvalue())


#: The fused models set against the ensemble and the best local, per seed and over seeds.
AGAINST = ("fused (kl)", HEADS, HEADS_LOG, "fused (nafi)")


def _differences(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per fused model of ``AGAINST``: its accuracy, log-likelihood and AUROC minus the ensemble's,
    and its accuracy above the best local BNN's, in points."""
    by = {r["model"]: r for r in rows}
    ens = by["ensemble"]
    best = max(r["accuracy"] for r in rows if r["model"].startswith("local "))
    return {
        name: {
            **{k: by[name][k] - ens[k] for k in ("accuracy", "loglik", "auroc")},
            "points": 100 * (by[name]["accuracy"] - best),
        }
        for name in AGAINST
    }


def _against(rows: list[dict]) -> str:
    """One line per fused model: its differences from the ensemble and the best local."""
    lines = []
    for name, d in _differences(rows).items():
        diff = ", ".join(f"{k} {d[k]:+.4f}" for k in ("accuracy", "loglik", "auroc"))
        lines.append(f"{name} - ensemble: {diff}; accuracy above the best local: {d['points']:+.1f} points")
    return "\n".join(lines)


def gains(runs: list[dict]) -> list[dict]:
    """The differences of :func:`_differences` over seeds: mean, sd, and on how many seeds the
    fused model is at or above the ensemble (for ``points``: at least 3 points above the best local)."""
    per_seed = [_differences(run["rows"]) for run in runs]
    out = []
    for name in AGAINST:
        row = {"model": name}
        for k in ("accuracy", "loglik", "auroc", "points"):
            values = _over_seeds(row, k, [d[name][k] for d in per_seed])
            row[k + "_seeds"] = int(np.sum(values >= (3.0 if k == "points" else 0.0)))
        out.append(row)
    return out


def _shown_gains(rows: list[dict], n_seeds: int) -> str:
    cells = [
        {
            "model": r["model"],
            **{
                k: f"{r[k]:+.4f} ± {r[k + '_sd']:.4f} ({r[k + '_seeds']}/{n_seeds})"
                for k in ("accuracy", "loglik", "auroc")
            },
            "points": f"{r['points']:+.1f} ± {r['points_sd']:.1f} ({r['points_seeds']}/{n_seeds})",
        }
        for r in rows
    ]
    return format_table(cells, ("model", "accuracy", "loglik", "auroc", "points"))


def _hidden(args) -> int | tuple[int, ...]:
    """``--hidden`` as train_bnn takes it: an int for one hidden layer, a tuple for several."""
    return args.hidden[0] if len(args.hidden) == 1 else tuple(args.hidden)


def _sizes(sizes) -> str:
    return "+".join(map(str, sizes))


def _tag(args) -> str:
    """The output files' name: the data set, the depth when there is more than one hidden layer, and
    the training size when it is limited."""
    tag = args.dataset if len(args.hidden) == 1 else f"{args.dataset}_{len(args.hidden)}layers"
    return tag if args.train_size is None else f"{tag}_n{args.train_size}"


if __name__ == "__main__":
    main()
