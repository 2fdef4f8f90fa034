"""Fusing horseshoe BNNs: accuracy, log-likelihood, entropy and OOD detection (KL-fusion section 5.4).

Usage: python benchmarks/bench_bnn_fusion.py [--dataset digits|fashion-mnist] [--clients 5]
       [--alpha 0.8] [--hidden 150] [--epochs N] [--samples S] [--seed 0] [--out bench-results]

Splits the training set with a Dirichlet(alpha) class skew, trains one horseshoe BNN per client,
fuses them by KL-fusion and by NAFI on the posteriors, and reports for each model: test
accuracy, test log-likelihood, mean predictive entropy on the test set and on font-rendered
digits (out of distribution), and the AUROC of entropy for telling them apart (Table 2,
Figure 5). Writes ``bnn_fusion_<dataset>.png``: per-class entropy on font digits centred at each
model's mean test entropy, and test images sorted by the fused model's entropy (Figure 1).
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import numpy as np

from bayesfuse import fuse
from bayesfuse._io import atomic_write_bytes
from bayesfuse.data import dirichlet_partition, load_dataset, load_font_digits
from bayesfuse.demo import format_table
from bayesfuse.metrics import accuracy, negative_log_likelihood, ood_auroc, predictive_entropy
from bayesfuse.models.bnn import BNNConfig, train_bnn


def evaluate_bnn(model, x_test, y_test, x_ood, samples):
    p, po = model.predict(x_test, samples), model.predict(x_ood, samples)
    h_in, h_out = predictive_entropy(p), predictive_entropy(po)
    return {"accuracy": accuracy(p, y_test), "loglik": -negative_log_likelihood(p, y_test),
            "entropy test": float(h_in.mean()), "entropy fonts": float(h_out.mean()),
            "auroc": ood_auroc(h_in, h_out)}, h_in, h_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--hidden", type=int, default=150)
    parser.add_argument("--epochs", type=int, default=None, help="default: 200 (digits), 30 (fashion-mnist)")
    parser.add_argument("--samples", type=int, default=100, help="Monte Carlo samples of the predictive")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "bench-results"))
    args = parser.parse_args()
    start = time.perf_counter()
    split = load_dataset(args.dataset, seed=args.seed).standardize()
    size = split.train.image_shape[0]
    fonts = load_font_digits(size, seed=args.seed)
    x_ood = split.standardizer.transform(fonts.x)
    epochs = args.epochs or (200 if args.dataset == "digits" else 30)
    part = dirichlet_partition(split.train.y, args.clients, args.alpha, seed=args.seed)
    print(f"{args.dataset}: {args.clients} clients (Dirichlet {args.alpha}), sizes {part.sizes.tolist()}, "
          f"{args.hidden}-unit horseshoe BNNs, {epochs} epochs")
    bnns, rows, entropies = [], [], {}
    for j, idx in enumerate(part):
        bnn = train_bnn(split.train.x[idx], split.train.y[idx], split.n_classes, args.hidden,
                        BNNConfig(epochs=epochs, seed=args.seed + j), name=f"client {j}")
        bnns.append(bnn)
        metrics, h_in, h_out = evaluate_bnn(bnn, split.test.x, split.test.y, x_ood, args.samples)
        rows.append({"model": f"local {j}", "units": args.hidden, "seconds": bnn.train_seconds, **metrics})
        entropies[f"local {j}"] = (h_in, h_out)
        print(format_table(rows[-1:], list(rows[-1])).splitlines()[-1], flush=True)
    fused_models = {}
    for method in ("kl", "nafi"):
        res = fuse(bnns, method)
        fused_models[method] = res.model
        metrics, h_in, h_out = evaluate_bnn(res.model, split.test.x, split.test.y, x_ood, args.samples)
        rows.append({"model": f"fused ({method})", "units": res.sizes[0], "seconds": res.seconds, **metrics})
        entropies[f"fused ({method})"] = (h_in, h_out)
        print(format_table(rows[-1:], list(rows[-1])).splitlines()[-1], flush=True)
    print()
    print(format_table(rows, list(rows[0])))
    local_auroc = np.mean([r["auroc"] for r in rows[: args.clients]])
    print(f"mean local AUROC {local_auroc:.4f}; seconds: training (locals) or fusion (fused)")
    print(f"whole study: {time.perf_counter() - start:.0f} s")
    path = _figure(args, split, fonts, entropies, fused_models["kl"])
    print(f"wrote {path}")


def _figure(args, split, fonts, entropies, fused):
    import matplotlib

    matplotlib.use("Agg")
    from bayesfuse.plot import plot_centred_entropy, plot_sorted_images

    fig = matplotlib.pyplot.figure(figsize=(12, 7.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1.2, 1])
    ax = top.subplots()
    plot_centred_entropy(entropies, fonts.y, ax=ax)
    ax.set_title(f"{args.dataset}: uncertainty on out-of-distribution font digits (Figure 5)")
    h = predictive_entropy(fused.predict(split.test.x, args.samples))
    raw = split.standardizer.scale * split.test.x + split.standardizer.mean
    plot_sorted_images(raw, h, split.test.image_shape, fig=bottom)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return atomic_write_bytes(Path(args.out) / f"bnn_fusion_{args.dataset}.png", buf.getvalue(), overwrite=True)


if __name__ == "__main__":
    main()
