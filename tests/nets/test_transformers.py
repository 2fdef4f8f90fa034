"""Hugging Face's transformers, traced from their modules (bayesfuse.nets.graph_spec), where
``transformers`` is installed (it is no dependency of bayesfuse; skipped without it).

Their forwards read a mask's minimum off the input's dtype (``torch.finfo(x.dtype)``), iterate
over and count sizes, and branch on them; the tracer takes those at the example input
(:mod:`bayesfuse.nets.decisions`). A small BERT classifier with its attention kernel
(``F.scaled_dot_product_attention`` at its default scale, which fixes the heads' widths) fuses
back from a permuted copy by PFNM and OT, and three independent ones fuse by PFNM, the heads held
at their width, the stream and the feed-forward layers grown.
"""

import pytest
import torch

from tests.helpers import far_from_identity_norms, permuted_copy

transformers = pytest.importorskip("transformers")


class _Classifier(torch.nn.Module):
    """The model called on token ids alone, its logits returned."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def _bert(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=50,
        max_position_embeddings=16,
        num_labels=3,
    )
    return far_from_identity_norms(_Classifier(transformers.BertForSequenceClassification(config))).eval()


def test_a_bert_classifier_fuses_back_and_fuses():
    import bayesfuse
    from bayesfuse.nets.graph_spec import spec_from_graph

    x = torch.randint(0, 50, (3, 8))
    model = _bert(0)
    spec = spec_from_graph(model, x[:1])
    assert spec.fixed and len(spec.groups) == 8
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        reference = model(x)
        scale = float(reference.abs().max())
        assert float((permuted(x) - reference).abs().max()) < 1e-4 * scale
        for method in ("pfnm", "ot"):
            fused = bayesfuse.fuse([model, permuted], method, example_input=x[:1]).model
            assert float((fused(x) - reference).abs().max()) < 1e-4 * scale, method
        fused = bayesfuse.fuse([_bert(s) for s in (1, 2, 3)], "pfnm", example_input=x[:1])
        sizes = dict(zip(fused.groups, fused.sizes))
        assert all(sizes[g] == 16 for g in fused.hyper["fixed"]) and max(sizes.values()) > 64
        assert fused.model(x).shape == (3, 3)
