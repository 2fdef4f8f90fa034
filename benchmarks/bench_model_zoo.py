"""The networks of model libraries, as users bring them: which torchvision and timm models the
tracer reads, and whether a permuted copy of each fuses back to it.

Usage: python benchmarks/bench_model_zoo.py [--library torchvision timm] [--models NAME ...]
       [--size 64] [--max-params 30e6] [--out bench-results/model_zoo.md]

torchvision and timm are no dependencies of bayesfuse: install them (the torchvision build that
matches your torch) to run this; a library that does not import is reported and skipped.

For each model (``num_classes=10``, random weights; every vector parameter and batch-norm
statistic drawn away from 1 and 0, ``tests.helpers.library_randomised``): the permutation spec
traced from its module at the model's own input size (``spec_from_graph``), its groups and the
groups whose width its forward fixes (``spec.fixed``) and the layers whose units it holds in
place (``spec.in_place``: they meet numbers along them that no permutation moves), or the first
line of the refusal; then,
for models of at most ``--max-params`` parameters, a copy with every group permuted at random
fused with the original by PFNM (which matches the groups whose width the forward fixes at that
width; ``--size`` pixels square where the model takes any size): the
largest absolute difference of the fused network's logits from the original's on 4 random
images, beside the largest logit (float32 round-off is about 1e-7 of it per layer, more through
deep stacks of batch norms), and the seconds it took; and the permuted copy's own largest
difference from the original, which shows that the spec describes a symmetry of the network
(matching undoes any permutation, so fusing back alone would pass a wrong spec too).

A model with ``nn.MultiheadAttention`` (torchvision's ViT) is traced as ``bayesfuse.fuse``
fuses it, split into one module per head (``split_heads``). A timm name ending in ``+eager``
builds the model with every attention module's fused kernel off (``fused_attn = False``): its
heads then follow the width each module holds (``self.head_dim``) and PFNM grows them, where
``F.scaled_dot_product_attention``'s default scale, read off the fused width, fixes them.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
from common import write_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers, from a checkout

import bayesfuse  # noqa: E402
from bayesfuse.nets.attention import multihead_modules, split_heads  # noqa: E402
from bayesfuse.nets.graph_spec import spec_from_graph  # noqa: E402
from tests.helpers import library_randomised, permuted_copy  # noqa: E402

TORCHVISION = (
    "resnet18 resnet50 resnext50_32x4d wide_resnet50_2 regnet_x_400mf mobilenet_v2 mobilenet_v3_small mnasnet0_5 "
    "efficientnet_b0 convnext_tiny densenet121 googlenet inception_v3 squeezenet1_0 vgg11_bn alexnet "
    "shufflenet_v2_x0_5 vit_b_16 swin_t maxvit_t"
).split()
TIMM = (
    "resnet18 resnet50d seresnext26d_32x4d res2net50_14w_8s cspresnet50 regnety_002 dla34 hrnet_w18_small "
    "selecsls42b hgnet_tiny efficientnet_b0 tinynet_a mobilenetv3_small_100 mobilenetv4_conv_small lcnet_050 "
    "ghostnet_100 rexnet_100 repvit_m1 fastvit_t8 xception41 densenet121 dpn68 tresnet_m nfnet_l0 convnext_atto "
    "convnextv2_atto poolformer_s12 convmixer_768_32 inception_next_tiny focalnet_tiny_srf edgenext_xx_small "
    "vit_tiny_patch16_224 vit_tiny_patch16_224+eager deit_tiny_patch16_224 deit_tiny_patch16_224+eager "
    "pit_ti_224 cait_xxs24_224 beit_base_patch16_224 "
    "eva02_tiny_patch14_224 swin_tiny_patch4_window7_224 twins_pcpvt_small visformer_tiny levit_128s "
    "efficientformer_l1 mixer_s16_224 resmlp_12_224 gcvit_xxtiny coat_tiny mobilevit_xxs efficientvit_b0 "
    "crossvit_tiny_240 nest_tiny vgg11"
).split()


def _builders(library: str):
    """``(name, build, input size or None)`` of each model the library holds, or a reason it cannot run."""
    if library == "torchvision":
        import torchvision.models as tv

        fixed = {"inception_v3": 299, "vit_b_16": 224, "swin_t": 224, "maxvit_t": 224}
        options = {"inception_v3": {"aux_logits": False, "init_weights": False}, "googlenet": {"aux_logits": False}}
        return {
            n: (lambda n=n: getattr(tv, n)(num_classes=10, **options.get(n, {})), fixed.get(n)) for n in TORCHVISION
        }
    import timm

    def build(n):
        name, _, variant = n.partition("+")
        model = timm.create_model(name, pretrained=False, num_classes=10)
        for m in model.modules():
            if variant == "eager" and hasattr(m, "fused_attn"):
                m.fused_attn = False
        return model

    return {n: (lambda n=n: build(n), None) for n in TIMM}


def _input_size(model, library: str, fixed: int | None, size: int) -> int:
    if fixed is not None:
        return fixed
    if library == "timm" and getattr(model, "pretrained_cfg", {}).get("fixed_input_size"):
        return int(model.pretrained_cfg["input_size"][-1])
    return size


def check(name: str, build, library: str, fixed: int | None, size: int, max_params: float) -> dict:
    torch.manual_seed(0)
    model = library_randomised(build())
    if multihead_modules(model):  # as bayesfuse.fuse fuses it: one module per head
        model = split_heads(model)
    params = sum(p.numel() for p in model.parameters())
    side = _input_size(model, library, fixed, size)
    x = torch.randn(4, 3, side, side)
    row = {"library": library, "model": name, "parameters": params, "input": side}
    try:
        start = time.perf_counter()
        spec = spec_from_graph(model, x[:1])
        row.update(
            traced="yes",
            groups=len(spec.groups),
            fixed=len(spec.fixed),
            in_place=len(spec.in_place),
            trace_s=time.perf_counter() - start,
        )
    except Exception as err:  # a refusal, reported in its first line
        row.update(traced="no", why=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return row
    if params > max_params:
        return row
    permuted = permuted_copy(model, spec, seed=1)
    method = "pfnm"  # groups whose width the forward fixes are matched at it
    with torch.no_grad():
        reference = model(x)
        # the spec's symmetry itself: a copy permuted by it computes the same function (else fusing it
        # back proves nothing: matching undoes any permutation, right or wrong)
        row["permuted_gap"] = float((permuted(x) - reference).abs().max())
        start = time.perf_counter()
        try:
            fused = bayesfuse.fuse([model, permuted], method, example_input=x[:1]).model
        except Exception as err:  # a refusal after tracing, reported in its first line
            row["why"] = f"{method}: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            return row
        row["method"], row["fuse_s"] = method, time.perf_counter() - start
        row["gap"] = float((fused(x) - reference).abs().max())
        row["scale"] = float(reference.abs().max())
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| library | model | parameters | traced | groups (fixed; layers in place) "
        "| a permuted copy fused back: method, max logit gap (largest logit) | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["traced"] == "no":
            lines.append(f"| {r['library']} | {r['model']} | {r['parameters'] / 1e6:.1f}M | no: {r['why']} | | | |")
            continue
        gap = f"{r['method']}, {r['gap']:.1e} ({r['scale']:.2g})" if "gap" in r else r.get("why", "-")
        if "permuted_gap" in r:  # the permuted copy's own difference from the network
            gap += f"; permuted copy {r['permuted_gap']:.1e}"
        seconds = f"{r['fuse_s']:.1f}" if "fuse_s" in r else "-"
        lines.append(
            f"| {r['library']} | {r['model']} | {r['parameters'] / 1e6:.1f}M | yes "
            f"| {r['groups']} ({r['fixed']}; {r['in_place']}) | {gap} | {seconds} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", nargs="+", default=["torchvision", "timm"], choices=["torchvision", "timm"])
    parser.add_argument("--models", nargs="+", help="names to check (default: the lists above)")
    parser.add_argument("--size", type=int, default=64, help="input pixels where a model takes any size")
    parser.add_argument("--max-params", type=float, default=30e6, help="fuse permuted copies up to this size")
    parser.add_argument("--out", default="bench-results/model_zoo.md")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    rows = []
    for library in args.library:
        try:
            builders = _builders(library)
        except Exception as err:  # not installed, or a build of it that does not import
            print(f"{library}: cannot import it ({type(err).__name__}: {str(err).splitlines()[0]}); skipped")
            continue
        for name in args.models or list(builders):
            if name not in builders:
                continue
            build, fixed = builders[name]
            row = check(name, build, library, fixed, args.size, args.max_params)
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    if rows:
        out = table(rows)
        write_text(args.out, out)
        print(out)


if __name__ == "__main__":
    main()
