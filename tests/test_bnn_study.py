"""A small version of benchmarks/bench_bnn_fusion.py on the embedded digits (fixed seeds)."""

import numpy as np

from bayesfuse import fuse
from bayesfuse.data import dirichlet_partition, load_digits, load_font_digits
from bayesfuse.metrics import accuracy, negative_log_likelihood, ood_auroc, predictive_entropy
from bayesfuse.models.bnn import BNNConfig, train_bnn


def test_fused_bnn_beats_every_local_one_and_knows_fonts_are_foreign():
    split = load_digits().standardize()
    fonts = split.standardizer.transform(load_font_digits(8, n_per_font=2))
    part = dirichlet_partition(split.train.y, 5, 0.8, seed=0)
    bnns = [
        train_bnn(split.train.x[i], split.train.y[i], 10, 60, BNNConfig(epochs=150, seed=j), verbose=False)
        for j, i in enumerate(part)
    ]
    res = fuse(bnns, "kl")

    def scores(model):
        p, po = model.predict(split.test.x, 100), model.predict(fonts.x, 100)
        h_in, h_out = predictive_entropy(p), predictive_entropy(po)
        return accuracy(p, split.test.y), -negative_log_likelihood(p, split.test.y), h_in, h_out

    local = [scores(b) for b in bnns]
    acc, loglik, h_in, h_out = scores(res.model)
    assert acc > max(s[0] for s in local)
    assert loglik > max(s[1] for s in local)
    assert res.sizes[0] < 5 * 60
    assert h_out.mean() > h_in.mean()
    assert ood_auroc(h_in, h_out) > np.mean([ood_auroc(s[2], s[3]) for s in local])
