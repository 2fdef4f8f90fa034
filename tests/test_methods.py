"""The method table: defaults, constraints, the one resolver, and agreement with the algorithms."""

import inspect
import subprocess
import sys

import pytest

from bayesfuse import methods
from bayesfuse.cli import main
from bayesfuse.inference.fedma import fedma
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.layerwise import match_group, match_layerwise
from bayesfuse.inference.matching import match_neurons
from bayesfuse.inference.otfusion import ot_fuse_layerwise


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
    (fedma, "fedma", "network"),
    (kl_fuse, "kl", "bnn"),
    (ot_fuse_layerwise, "ot", "network"),
]


@pytest.mark.parametrize("function, method, kind", ALGORITHMS, ids=[f[0].__name__ for f in ALGORITHMS])
def test_algorithm_signature_defaults_agree_with_the_table(function, method, kind):
    params = inspect.signature(function).parameters
    shared = [k for k in methods.METHODS[method].defaults[kind] if k in params]
    assert shared, f"{function.__name__} shares no key with the {method!r} row"
    for key in shared:
        assert params[key].default == methods.METHODS[method].defaults[kind][key], (function.__name__, key)


def test_resolve_fills_defaults_and_converts():
    hyper = methods.resolve("nafi", "network", {"noise_var": 3, "n_iter": 4.0, "cost": "marginal", "gamma0": None})
    assert hyper["noise_var"] == 3.0 and isinstance(hyper["noise_var"], float)
    assert hyper["n_iter"] == 4 and isinstance(hyper["n_iter"], int)
    assert hyper["gamma0"] == methods.METHODS["nafi"].defaults["network"]["gamma0"]  # None keeps the default
    assert methods.resolve("pfnm", "bnn")["noise_var"] == 0.01  # defaults differ per kind
    assert methods.resolve("pfnm", "network")["noise_var"] == "auto"
    assert methods.resolve("pfnm", "network", {"noise_var": "auto", "prior_var": 2})["prior_var"] == 2.0


@pytest.mark.parametrize("call, exc, message", [
    (lambda: methods.resolve("hungarian"), ValueError, "unknown method 'hungarian': method must be one of"),
    (lambda: methods.resolve("kl", "network"), ValueError, "method 'kl' fuses Bayesian networks"),
    (lambda: methods.resolve("fedavg", "bnn"), ValueError, "methods for Bayesian networks .*: pfnm, nafi, kl"),
    (lambda: methods.resolve("pfnm", "network", {"reg": 1.0}), ValueError, r"unknown hyper-parameters \['reg'\]"),
    (lambda: methods.resolve("pfnm", "bnn", {"direction": "top-down"}), ValueError, "direction only for network"),
    (lambda: methods.resolve("pfnm", "network", {"kl_weight": 0.1}), ValueError, "use method='nafi'"),
    (lambda: methods.resolve("nafi", "network", {"kl_weight": -1}), ValueError, "kl_weight must be non-negative"),
    (lambda: methods.resolve("nafi", "network", {"noise_var": 0}), ValueError, "noise_var must be positive"),
    (lambda: methods.resolve("nafi", "network", {"noise_var": float("nan")}), ValueError, "noise_var"),
    (lambda: methods.resolve("nafi", "network", {"noise_var": "big"}), ValueError, "noise_var must be positive or one of 'auto'"),
    (lambda: methods.resolve("nafi", "network", {"noise_var": [1.0]}), TypeError, "noise_var must be float or str"),
    (lambda: methods.resolve("nafi", "network", {"n_iter": 2.5}), TypeError, r"n_iter must be int \(a positive integer\)"),
    (lambda: methods.resolve("pfnm", "network", {"direction": "sideways"}), ValueError, "direction must be one of"),
    (lambda: methods.resolve("kl", "bnn", {"average_outputs": "yes"}), ValueError, "average_outputs must be true or"),
    (lambda: methods.resolve("pfnm", "tree"), ValueError, "kind must be one of network, bnn"),
])
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


def test_names_and_kinds():
    assert methods.names("bnn") == ("pfnm", "nafi", "kl")
    assert methods.names(needs_data=True) == ("fedma",)
    assert set(methods.names()) == set(methods.METHODS)


def test_fuse_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit) as info:
        main(["fuse", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for name, m in methods.METHODS.items():
        assert f"{name}: " in text
        for key in m.keys():
            if key != "kl_weight" or name != "pfnm":
                assert f"    {key} = " in text, (name, key)
    assert "noise_var = network: 'auto', bnn: 0.01" in text


def test_command_line_parser_loads_neither_torch_nor_the_algorithms():
    code = ("import sys; from bayesfuse.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'pyro', 'scipy', 'bayesfuse.core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
