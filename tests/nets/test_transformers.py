"""Hugging Face's transformers, traced from their modules (bayesfuse.nets.graph_spec), where
``transformers`` is installed (it is no dependency of bayesfuse; skipped without it).

Their forwards read a mask's minimum off the input's dtype (``torch.finfo(x.dtype)``), iterate
over and count sizes, and branch on them; the tracer takes those at the example input
(:mod:`bayesfuse.nets.decisions`). A small BERT classifier with its attention kernel
(``F.scaled_dot_product_attention`` at its default scale, which fixes the heads' widths) fuses
back from a permuted copy by PFNM and OT, and three independent ones fuse by PFNM, the heads held
at their width, the stream and the feed-forward layers grown. So do GPT-2 (a classifier and a
language model), and Llama, Gemma and Qwen2, whose rotary queries and keys stay in place
(:attr:`~bayesfuse.inference.spec.PermutationSpec.in_place`).
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


#: The sizes of every small model below: 2 layers, a stream of 32, 2 heads, MLPs of 64.
_SIZES = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=2,
    intermediate_size=64,
    vocab_size=50,
    max_position_embeddings=16,
)


def _bert(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(num_labels=3, **_SIZES)
    return far_from_identity_norms(_Classifier(transformers.BertForSequenceClassification(config))).eval()


def _fuses_back_and_fuses(make, x) -> tuple:
    """The spec of ``make(0)`` after its permuted copy (every group permuted) computes its
    function and fuses back to it by PFNM and OT; and the PFNM fusion of ``make(1..3)``."""
    import bayesfuse
    from bayesfuse.nets.graph_spec import spec_from_graph

    model = make(0)
    spec = spec_from_graph(model, x[:1])
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        reference = model(x)
        scale = float(reference.abs().max())
        assert float((permuted(x) - reference).abs().max()) < 1e-4 * scale
        for method in ("pfnm", "ot"):
            fused = bayesfuse.fuse([model, permuted], method, example_input=x[:1]).model
            assert float((fused(x) - reference).abs().max()) < 1e-4 * scale, method
        fused = bayesfuse.fuse([make(s) for s in (1, 2, 3)], "pfnm", example_input=x[:1])
        assert fused.model(x).shape == reference.shape
    return spec, fused


def test_a_bert_classifier_fuses_back_and_fuses():
    spec, fused = _fuses_back_and_fuses(_bert, torch.randint(0, 50, (3, 8)))
    assert spec.fixed and len(spec.groups) == 8
    sizes = dict(zip(fused.groups, fused.sizes))
    assert all(sizes[g] == 16 for g in fused.hyper["fixed"]) and max(sizes.values()) > 64


def _gpt2(seed: int, head: str = "classifier") -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, num_labels=3)
    config.pad_token_id = 0
    make = transformers.GPT2ForSequenceClassification if head == "classifier" else transformers.GPT2LMHeadModel
    return far_from_identity_norms(_Classifier(make(config))).eval()


def _llama(seed: int, kv_heads: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_key_value_heads=kv_heads, **_SIZES)
    return far_from_identity_norms(_Classifier(transformers.LlamaForCausalLM(config))).eval()


def _rotary(kind: str):
    """A Gemma (its norms scale by ``1 + self.weight``) or Qwen2 (biases on its queries, keys and
    values) language model, one key/value head for two query heads."""

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        sizes = dict(_SIZES, num_key_value_heads=1)
        if kind == "gemma":
            model = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=16, **sizes))
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
        return far_from_identity_norms(_Classifier(model)).eval()

    return make


@pytest.mark.parametrize(
    "make",
    [_gpt2, lambda s: _gpt2(s, "lm"), _llama, lambda s: _llama(s, 1), _rotary("gemma"), _rotary("qwen2")],
    ids=["gpt2", "gpt2-lm", "llama", "gqa", "gemma", "qwen2"],
)
def test_decoders_fuse_back_and_fuse(make):
    """GPT-2 (its key/value cache starts as an empty tensor it concatenates to, its layers
    ``Conv1D``) and Llama (rotary position embeddings: the queries and keys stay in place; one
    key/value head for two query heads too) fuse back from permuted copies by PFNM and OT, and
    three independent ones fuse by PFNM with the stream and the MLPs grown."""
    spec, fused = _fuses_back_and_fuses(make, torch.randint(1, 50, (3, 8)))
    rotary = "GPT2" not in type(make(0).model).__name__
    assert bool(spec.in_place) == rotary and all(k.endswith(("q_proj", "k_proj")) for k in spec.in_place)
    sizes = dict(zip(fused.groups, fused.sizes))
    assert sizes[fused.groups[0]] > 32 and max(sizes.values()) > 64
