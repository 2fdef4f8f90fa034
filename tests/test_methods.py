"""The method table: defaults, constraints, the one resolver, and agreement with the algorithms."""

import inspect
import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from bayesfuse import methods
from bayesfuse.checkpoints import load_state_dict, save_state_dict
from bayesfuse.cli import main
from bayesfuse.inference.fedma import fedma, fedma_steps
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.layerwise import match_group, match_layerwise
from bayesfuse.inference.matching import match_neurons
from bayesfuse.inference.otfusion import ot_fuse_layerwise
from bayesfuse.models.bnn import HorseshoeBNN
from bayesfuse.nets.mlp import MLP


def test_every_default_satisfies_its_constraint():
    for name, m in methods.METHODS.items():
        for kind in m.kinds:
            assert methods.resolve(name, kind) == m.defaults[kind]
            for key, value in m.defaults[kind].items():
                assert m.constraint(key).check(value) == value, (name, kind, key)


# (function, method row, kind): the algorithm's own signature defaults must be the table's.
ALGORITHMS = [
    (match_neurons, "pfnm", "network"),
    (match_group, "pfnm", "network"),
    (match_layerwise, "pfnm", "network"),
    (fedma_steps, "fedma", "network"),  # fedma() drives it and passes its keywords on
    (kl_fuse, "kl", "bnn"),
    (ot_fuse_layerwise, "ot", "network"),
]


# Defaults that differ on purpose, with the reason. kl_fuse fuses any mean-field posteriors and
# keeps the paper's lambda = 0.1 (Gaussian mixtures, bench_mixture_fusion.py); the BNN row fuses
# pruned units in the effective form, where validation log-likelihood chose 0.01 (methods.py).
# match_neurons serves every cost and fixed hyper-parameters too (FedMA, BNN units), where the recorded
# log posterior is not what the sweeps optimise: it sweeps to the fixed point unless told to stop; the
# network row stops at 0.1 nats per unit (studied there, methods.py).
DIFFERS = {("kl_fuse", "reg"): (0.1, 0.01), ("match_neurons", "tol"): (None, 0.1)}


@pytest.mark.parametrize("function, method, kind", ALGORITHMS, ids=[f[0].__name__ for f in ALGORITHMS])
def test_algorithm_signature_defaults_agree_with_the_table(function, method, kind):
    params = inspect.signature(function).parameters
    shared = [k for k in methods.METHODS[method].defaults[kind] if k in params]
    assert shared, f"{function.__name__} shares no key with the {method!r} row"
    for key in shared:
        expected = DIFFERS.get((function.__name__, key), (methods.METHODS[method].defaults[kind][key],) * 2)
        assert (params[key].default, methods.METHODS[method].defaults[kind][key]) == expected, (function.__name__, key)


def test_resolve_fills_defaults_and_converts():
    hyper = methods.resolve("nafi", "network", {"noise_var": 3, "n_iter": 4.0, "cost": "marginal", "gamma0": None})
    assert hyper["noise_var"] == 3.0 and isinstance(hyper["noise_var"], float)
    assert hyper["n_iter"] == 4 and isinstance(hyper["n_iter"], int)
    assert hyper["gamma0"] == methods.METHODS["nafi"].defaults["network"]["gamma0"]  # None keeps the default
    assert methods.resolve("pfnm", "bnn")["noise_var"] == 0.01  # defaults differ per kind
    assert methods.resolve("pfnm", "network")["noise_var"] == "auto"
    assert methods.resolve("pfnm", "network", {"noise_var": "auto", "prior_var": 2})["prior_var"] == 2.0


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda: methods.resolve("hungarian"), ValueError, "unknown method 'hungarian': method must be one of"),
        (lambda: methods.resolve("kl", "network"), ValueError, "method 'kl' fuses Bayesian networks"),
        (lambda: methods.resolve("fedavg", "bnn"), ValueError, "methods for Bayesian networks .*: pfnm, nafi, kl"),
        (lambda: methods.resolve("pfnm", "network", {"reg": 1.0}), ValueError, r"unknown hyper-parameters \['reg'\]"),
        (lambda: methods.resolve("pfnm", "bnn", {"direction": "top-down"}), ValueError, "direction only for network"),
        (lambda: methods.resolve("pfnm", "network", {"kl_weight": 0.1}), ValueError, "use method='nafi'"),
        (lambda: methods.resolve("nafi", "network", {"kl_weight": -1}), ValueError, "kl_weight must be non-negative"),
        (lambda: methods.resolve("nafi", "network", {"noise_var": 0}), ValueError, "noise_var must be positive"),
        (lambda: methods.resolve("nafi", "network", {"noise_var": float("nan")}), ValueError, "noise_var"),
        (
            lambda: methods.resolve("nafi", "network", {"noise_var": "big"}),
            ValueError,
            r"noise_var must be positive, in \[1e-50, 1e\+50\] \(.*\) or one of 'auto'",
        ),
        (lambda: methods.resolve("nafi", "network", {"noise_var": [1.0]}), TypeError, "noise_var must be float or str"),
        (
            lambda: methods.resolve("nafi", "network", {"n_iter": 2.5}),
            TypeError,
            r"n_iter must be int \(a positive integer\)",
        ),
        (lambda: methods.resolve("pfnm", "network", {"direction": "sideways"}), ValueError, "direction must be one of"),
        (
            lambda: methods.resolve("kl", "bnn", {"average_outputs": "yes"}),
            ValueError,
            "average_outputs must be true or",
        ),
        (lambda: methods.resolve("pfnm", "tree"), ValueError, "kind must be one of network, bnn"),
    ],
)
def test_resolve_refuses_bad_settings_with_a_clear_message(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_parse_assignments_types_values_from_the_table():
    parsed = methods.parse_assignments("kl", ["reg=0.5", "n_iter=7", "solver=cvxpy", "average_outputs=false"])
    assert parsed == {"reg": 0.5, "n_iter": 7, "solver": "cvxpy", "average_outputs": False}
    with pytest.raises(ValueError, match="key=value"):
        methods.parse_assignments("kl", ["reg"])
    with pytest.raises(ValueError, match="unknown hyper-parameter 'noise_var' for kl"):
        methods.parse_assignments("kl", ["noise_var=1"])
    with pytest.raises(ValueError, match=r"hyper-parameter n_iter must be int \(a positive integer\), got 'ten'"):
        methods.parse_assignments("nafi", ["n_iter=ten"])
    with pytest.raises(ValueError, match="use method='nafi'"):
        methods.parse_assignments("pfnm", ["kl_weight=0.1"])


def test_unknown_key_lists_the_keys_by_the_kind_of_input_that_takes_them():
    """The command line parses ``--hyper`` before it reads the files, so the list names which
    keys networks take and which BNNs alone (PFNM's pruning keys fuse no network)."""
    with pytest.raises(ValueError) as caught:
        methods.parse_assignments("pfnm", ["bogus=1"])
    known = str(caught.value).split("known: ")[1]
    common, networks, bnns = known.split("; ")
    assert "noise_var" in common and "prune_kl" not in common and "tol" not in common
    assert networks.startswith("for networks also ") and "tol" in networks and "prune_kl" not in networks
    assert bnns.startswith("for BNNs also ") and "prune_kl" in bnns and "tol" not in bnns
    for kind, words in (("network", networks), ("bnn", bnns)):  # together, exactly the kind's keys
        listed = common.split(", ") + words.split(" also ")[1].split(", ")
        assert sorted(listed) == sorted(methods.defaults("pfnm", kind))
    with pytest.raises(ValueError, match=r"known: anchor, reg, n_iter$"):  # one kind: one list
        methods.parse_assignments("ot", ["bogus=1"])


def test_names_and_kinds():
    assert methods.names("bnn") == ("pfnm", "nafi", "kl")
    assert methods.names(needs_data=True) == ("fedma",)
    assert set(methods.names()) == set(methods.METHODS)


def test_every_row_names_a_fuser_for_each_kind_it_fuses_in_one_shot():
    from bayesfuse._lazy import load

    for name, m in methods.METHODS.items():
        assert tuple(m.fusers) == (() if m.needs_data else m.kinds), name
        for path in m.fusers.values():
            assert callable(load(path)), (name, path)
    with pytest.raises(ValueError, match="fusers for"):
        methods.Method("x", "no fuser", {"network": {}})


def test_flags_give_the_entry_points_their_method_lists():
    assert methods.names("network", baseline=False, aliases=True) == ("pfnm", "nafi", "fedma", "ot", "fedma-nafi")
    assert methods.names(needs_data=False, baseline=False) == ("pfnm", "nafi", "ot", "kl")
    assert methods.names("network", featured=True) == ("pfnm", "nafi")
    assert methods.DEVICE_METHODS == ("pfnm", "nafi")
    assert [m for m in methods.METHODS.values() if not m.aligns_units] == [methods.METHODS["fedavg"]]


def test_fedma_with_nafis_penalty_is_one_row_with_a_variant():
    fedma_row, variant = methods.lookup("fedma-nafi")
    assert (fedma_row.name, variant) == ("fedma", "nafi")
    assert methods.lookup("pfnm") == (methods.METHODS["pfnm"], None)
    with pytest.raises(ValueError, match="unknown method 'fedavg-rounds'"):
        methods.lookup("fedavg-rounds")
    nafi_kl = methods.defaults("nafi")["kl_weight"]
    assert methods.resolve("fedma", variant="nafi")["kl_weight"] == nafi_kl
    assert methods.resolve("fedma", variant="nafi", given={"kl_weight": 0.5})["kl_weight"] == 0.5
    assert methods.resolve("fedma", variant="pfnm")["kl_weight"] == methods.resolve("fedma")["kl_weight"] == 0.0
    assert methods.resolve("fedma", given={"kl_weight": 0.5})["kl_weight"] == 0.5
    with pytest.raises(ValueError, match="use method='nafi'"):
        methods.resolve("fedma", given={"kl_weight": 0.5}, variant="pfnm")
    with pytest.raises(ValueError, match="variants 'pfnm', 'nafi', got 'ot'"):
        methods.resolve("fedma", variant="ot")


@pytest.mark.parametrize("name", list(methods.METHODS))
def test_methods_command_lists_every_key_with_its_default(capsys, name):
    assert main(["methods", name.upper()]) == 0  # any case
    text = capsys.readouterr().out
    assert text.startswith(f"{name}: ")
    for key in methods.METHODS[name].keys():
        if key != "kl_weight" or name != "pfnm":  # fixed at 0 for pfnm: nothing to set
            assert f"    {key} = " in text, (name, key)
    if name == "pfnm":
        assert "    kl_weight = " not in text


def test_methods_command_shows_one_kinds_keys_and_defaults(capsys):
    assert main(["methods", "pfnm"]) == 0
    assert "noise_var = network: 'auto', bnn: 0.01" in capsys.readouterr().out
    assert main(["methods", "pfnm", "--kind", "network"]) == 0
    network = capsys.readouterr().out
    assert "noise_var = 'auto'" in network and "direction = " in network
    assert not any(f"    {key} = " in network for key in ("unit_form", "prune_kl", "head"))  # BNN-only keys
    assert main(["methods", "pfnm", "--kind", "bnn"]) == 0
    bnn = capsys.readouterr().out
    assert "noise_var = 0.01" in bnn and "unit_form = 'raw'" in bnn and "    direction = " not in bnn
    assert main(["methods", "kl", "--kind", "network"]) == 0
    assert "kl: not for point-estimate networks" in capsys.readouterr().out


def test_methods_command_lists_the_methods_and_marks_those_bayesfuse_fuse_refuses(capsys):
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    for name, m in methods.METHODS.items():
        assert f"  {name} " in text
    fedma = text[text.index("  fedma ") : text.index("  fedavg ")]
    assert "not bayesfuse fuse" in " ".join(fedma.split())


def test_methods_command_suggests_the_closest_name(capsys):
    assert main(["methods", "nafy"]) == 2
    assert capsys.readouterr().err == (
        "bayesfuse methods: error: unknown method 'nafy': method must be one of pfnm, "
        "nafi, fedma, fedavg, ot, kl (did you mean 'nafi'?)\n"
    )


def test_method_names_are_case_insensitive_and_typos_get_the_closest_name():
    assert methods.canonical("PFNM") == "pfnm" and methods.canonical(" Nafi ") == "nafi"
    assert methods.canonical("FedMA-NAFI", aliases=True) == "fedma-nafi"
    assert methods.lookup("FEDMA-nafi") == (methods.METHODS["fedma"], "nafi")
    assert methods.resolve("NAFI", "network")["kl_weight"] == methods.defaults("nafi")["kl_weight"]
    with pytest.raises(ValueError, match=r"unknown method 'pfmn': .* \(did you mean 'pfnm'\?\)"):
        methods.canonical("pfmn")
    with pytest.raises(ValueError, match="unknown method 'fedma-nafi'"):
        methods.canonical("fedma-nafi")  # an alias is a name only where aliases are asked for
    with pytest.raises(ValueError, match=r"unknown method 3"):
        methods.canonical(3)


def test_unknown_keys_name_the_closest_key_or_argument():
    with pytest.raises(ValueError, match=r"unknown hyper-parameters \['noise_vr'\] .*\(did you mean 'noise_var'\?\)"):
        methods.resolve("pfnm", "network", {"noise_vr": 1.0})
    with pytest.raises(ValueError, match=r"unknown hyper-parameter 'n_iters' for kl \(did you mean 'n_iter'\?\)"):
        methods.parse_assignments("kl", ["n_iters=3"])

    def fuse_like(models, method="pfnm", *, class_counts=None, seed=0, **hyper):
        methods.check_keys(method, hyper, caller=fuse_like)

    fuse_like([], class_counts=None, noise_var=1.0)  # keys of any kind the method takes pass
    with pytest.raises(
        ValueError,
        match=r"\['class_count'\] for method 'pfnm', and not arguments of fuse_like "
        r"\(did you mean 'class_counts'\?\)",
    ):
        fuse_like([], class_count=[1, 2])
    with pytest.raises(
        ValueError,
        match=r"\['gama0', 'sed'\] .* \('gama0': did you mean 'gamma0'\?\) "
        r"\('sed': did you mean 'seed'\?\)",
    ):
        fuse_like([], gama0=1.0, sed=2)
    with pytest.raises(ValueError, match=r"\['banana'\] for method 'kl', and not arguments of fuse_like; kl's"):
        fuse_like([], "kl", banana=1)


def test_only_methods_that_fuse_models_alone_pass_check_one_shot():
    for name in methods.names(needs_data=False):
        methods.check_one_shot(name.upper())
    with pytest.raises(ValueError, match="fedma retrains each client between layers, so it needs the clients' data"):
        methods.check_one_shot("fedma")


def test_command_line_parser_loads_neither_torch_nor_the_algorithms():
    code = (
        "import sys; from bayesfuse.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'pyro', 'scipy', 'bayesfuse.core') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------- extreme hyper-parameters
# The matching's float64 arithmetic holds for variances in [1e-50, 1e50], gamma0 in [1e-300, 1e300]
# and kl_weight up to 1e50 (the derivation is with the constraints in bayesfuse/methods.py). Each
# value below either fuses cleanly (no RuntimeWarning from anywhere, a strict-JSON report with
# finite objectives, finite weights) or is refused in one line naming the key and its range.

VARIANCE_RANGE = "in [1e-50, 1e+50]"
GAMMA0_RANGE = "in [1e-300, 1e+300]"
EXTREMES = [
    # (key, value, None if it must fuse, else the range the refusal names)
    ("noise_var", "1e-300", VARIANCE_RANGE),
    ("noise_var", "5e-324", VARIANCE_RANGE),
    ("noise_var", "1e308", VARIANCE_RANGE),
    ("noise_var", "1e400", VARIANCE_RANGE),
    ("noise_var", "1e-50", None),
    ("noise_var", "1e50", None),
    ("prior_var", "1e-310", VARIANCE_RANGE),
    ("prior_var", "1e308", VARIANCE_RANGE),
    ("prior_var", "1e-50", None),
    ("prior_var", "1e50", None),
    ("gamma0", "5e-324", GAMMA0_RANGE),
    ("gamma0", "1e-308", GAMMA0_RANGE),
    ("gamma0", "1e308", GAMMA0_RANGE),
    ("gamma0", "1e-300", None),
    ("gamma0", "1e300", None),
]
KL_EXTREMES = [("kl_weight", "1e300", "at most 1e+50"), ("kl_weight", "1e50", None)]
# every key at the same end of its range at once, and at opposite ends
CORNERS = [
    "noise_var=1e-50 prior_var=1e50 gamma0=1e300",
    "noise_var=1e50 prior_var=1e-50 gamma0=1e-300",
    "noise_var=1e-50 prior_var=1e-50 gamma0=1e-300",
    "noise_var=1e50 prior_var=1e50 gamma0=1e300",
]


def _mlp_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(4, 6, generator=g),
        "fc1.bias": torch.randn(4, generator=g),
        "fc2.weight": torch.randn(3, 4, generator=g),
        "fc2.bias": torch.randn(3, generator=g),
    }


def _bnn_state(seed):
    torch.manual_seed(seed)
    return HorseshoeBNN(6, 4, 3).state_dict()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("extremes")
    return {
        kind: [save_state_dict(make(s), root / f"{kind}{s}.pt") for s in range(2)]
        for kind, make in (("network", _mlp_state), ("bnn", _bnn_state))
    }


def _strict_json(path):
    def refuse(constant):
        raise AssertionError(f"report holds {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _fuse_extreme(files, kind, method, assignments, refused, tmp_path, capsys):
    out = tmp_path / "fused.pt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["fuse", *map(str, files[kind]), "--method", method, "--hyper", *assignments, "--out", str(out)])
    runtime = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not runtime, runtime
    err = capsys.readouterr().err.strip()
    if refused is not None:
        key = assignments[-1].partition("=")[0]
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"{key} must be " in err and refused in err, err
        assert not out.exists()
        return
    assert code == 0, err
    report = _strict_json(tmp_path / "fused.pt.json")
    assert report["hyper_given"] == {k: float(v) for k, v in (a.split("=") for a in assignments)}
    for layer in report["layers"]:
        assert layer["objective"] and all(isinstance(v, float) and math.isfinite(v) for v in layer["objective"])
    fused = load_state_dict(out)
    assert all(torch.isfinite(t).all() for t in fused.values() if t.is_floating_point())


@pytest.mark.catalogue
@pytest.mark.parametrize("kind", ["network", "bnn"])
@pytest.mark.parametrize("method", ["pfnm", "nafi"])
@pytest.mark.parametrize("key, value, refused", EXTREMES, ids=[f"{k}={v}" for k, v, _ in EXTREMES])
def test_cli_extreme_hyper_fuses_cleanly_or_is_refused(
    model_files, tmp_path, capsys, kind, method, key, value, refused
):
    _fuse_extreme(model_files, kind, method, [f"{key}={value}"], refused, tmp_path, capsys)


@pytest.mark.catalogue
@pytest.mark.parametrize("kind", ["network", "bnn"])
@pytest.mark.parametrize("key, value, refused", KL_EXTREMES, ids=[f"{k}={v}" for k, v, _ in KL_EXTREMES])
def test_cli_extreme_kl_weight(model_files, tmp_path, capsys, kind, key, value, refused):
    # at the variance bounds, where NAFI's KL terms are largest (sigma0^2 / sigma^2 = 1e100)
    _fuse_extreme(
        model_files, kind, "nafi", ["noise_var=1e-50", "prior_var=1e50", f"{key}={value}"], refused, tmp_path, capsys
    )


@pytest.mark.catalogue
@pytest.mark.parametrize("kind", ["network", "bnn"])
@pytest.mark.parametrize("method", ["pfnm", "nafi"])
@pytest.mark.parametrize("corner", CORNERS)
def test_cli_hyper_at_the_corners_of_the_ranges_fuses_cleanly(model_files, tmp_path, capsys, kind, method, corner):
    _fuse_extreme(model_files, kind, method, corner.split(), None, tmp_path, capsys)


@pytest.mark.catalogue
@pytest.mark.parametrize("key, value, refused", EXTREMES[:4] + EXTREMES[6:8] + EXTREMES[10:13])
def test_cli_refuses_extreme_fedma_hyper_by_its_range(model_files, tmp_path, capsys, key, value, refused):
    # fedma's files are refused anyway (it needs the clients' data); the value is refused first
    out = tmp_path / "fused.pt"
    assert (
        main(
            [
                "fuse",
                *map(str, model_files["network"]),
                "--method",
                "fedma",
                "--hyper",
                f"{key}={value}",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{key} must be " in err and refused in err, err


@pytest.mark.catalogue
@pytest.mark.parametrize("corner", CORNERS)
@pytest.mark.parametrize("kl_weight", [0.0, 1e50])
def test_fedma_at_the_corners_of_the_ranges_is_clean(corner, kl_weight):
    # The "fedma" row through resolve() and the server loop, clients' retraining a no-op.
    given = {k: float(v) for k, v in (a.split("=") for a in corner.split())}
    settings = methods.resolve("fedma", "network", dict(given, kl_weight=kl_weight))
    settings.pop("passes")
    torch.manual_seed(0)
    nets = [MLP(6, [4, 5], 3) for _ in range(2)]
    states = [{k: v.double().numpy() for k, v in m.state_dict().items()} for m in nets]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fedma(
            states,
            nets[0].permutation_spec(),
            lambda jobs, frozen: [s for _, s in jobs],
            class_counts=np.ones((2, 3)),
            **settings,
        )
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert all(np.isfinite(v).all() for v in res.state_dict.values())
    assert all(np.isfinite(layer.objective).all() for layer in res.layers.values())
    for key, value in (("noise_var", 1e-300), ("prior_var", 1e308), ("gamma0", 5e-324), ("kl_weight", 1e300)):
        with pytest.raises(ValueError, match=f"{key} must be (positive|non-negative), (in|at most)"):
            methods.resolve("fedma", "network", {key: value})
