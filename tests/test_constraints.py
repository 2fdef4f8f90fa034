"""One validation layer: the constraints' error and message, validate_params, and the public
algorithms checking their hyper-parameters once on entry, before any work."""

import numpy as np
import pytest

from bayesfuse import methods
from bayesfuse.constraints import (
    KEYS,
    MATCHING,
    NON_NEGATIVE,
    POSITIVE_INT,
    Either,
    Fixed,
    Interval,
    InvalidParameterError,
    Numbers,
    Options,
    OrNone,
    check,
    message,
    validate_params,
)


def test_the_error_is_a_value_error_and_a_type_error():
    assert issubclass(InvalidParameterError, ValueError) and issubclass(InvalidParameterError, TypeError)
    for value in (0, "ten", 2.5, None):
        with pytest.raises(ValueError):
            check("n_iter", POSITIVE_INT, value)
        with pytest.raises(TypeError):
            check("n_iter", POSITIVE_INT, value)


def test_one_message_format():
    with pytest.raises(InvalidParameterError) as info:
        check("n_iter", POSITIVE_INT, 0)
    assert str(info.value) == message("n_iter", POSITIVE_INT, 0) == "n_iter must be a positive integer, got 0"
    with pytest.raises(InvalidParameterError) as info:
        check("n_iter", POSITIVE_INT, "ten")
    assert (
        str(info.value)
        == message("n_iter", POSITIVE_INT, "ten", wrong_type=True)
        == "n_iter must be int (a positive integer), got 'ten' (str)"
    )
    assert (
        str(pytest.raises(InvalidParameterError, check, "cost", KEYS["cost"], "x").value)
        == "cost must be one of 'auto', 'pfnm', 'marginal', got 'x'"
    )
    # a Fixed value gives its own reason; `shown` is what the message quotes
    assert (
        str(pytest.raises(InvalidParameterError, check, "kl_weight", Fixed(0.0, "no penalty here"), 1.0).value)
        == "no penalty here"
    )
    assert "got '0'" in str(pytest.raises(InvalidParameterError, check, "n_iter", POSITIVE_INT, 0, shown="0").value)


def test_check_converts_as_the_constraint_says():
    assert check("n_iter", POSITIVE_INT, 4.0) == 4 and isinstance(check("n_iter", POSITIVE_INT, 4.0), int)
    assert type(check("reg", NON_NEGATIVE, np.float32(0.5))) is float
    array = np.ones(3)
    assert check("noise_var", MATCHING["noise_var"], array) is array  # shapes are the data's to check
    assert check("tol", OrNone(KEYS["tol"]), None) is None
    assert MATCHING["noise_var"] == Either((Numbers(), Options(("auto",))))
    for bad in (True, None, "big"):
        with pytest.raises(InvalidParameterError, match="noise_var must be"):
            check("noise_var", MATCHING["noise_var"], bad)


def test_validate_params_checks_once_on_entry_and_passes_converted_values():
    calls = []

    @validate_params(n_iter=POSITIVE_INT, reg=NON_NEGATIVE, init=Options(("greedy",)))
    def run(data, *, n_iter=10, reg=0.0, init=None, other="x"):
        calls.append((data, n_iter, reg, init, other))
        return n_iter

    data = object()
    assert run(data, n_iter=3.0, reg=1, other=[1]) == 3
    assert calls[-1] == (data, 3, 1.0, None, [1]) and type(calls[-1][2]) is float
    assert calls[-1][0] is data  # arguments without a constraint are left alone
    run(data, init=None)  # None passes where it is the default
    with pytest.raises(InvalidParameterError, match="n_iter must be a positive integer, got 0"):
        run(data, n_iter=0)
    with pytest.raises(InvalidParameterError, match="reg must be non-negative, got -1"):
        run(data, reg=-1)
    assert len(calls) == 2  # the function never ran for bad values
    with pytest.raises(TypeError, match="unexpected keyword"):
        run(data, n_iters=3)  # a call the signature refuses is refused as before
    assert run.parameter_constraints["n_iter"] is POSITIVE_INT and run.__name__ == "run"
    with pytest.raises(TypeError, match="no parameters"):
        validate_params(nope=POSITIVE_INT)(run.__wrapped__)


def test_the_table_takes_each_keys_constraint_from_one_place():
    for key, param in methods.PARAMS.items():
        assert param.constraint is KEYS[key], key
    assert methods.METHODS["ot"].constraint("reg") is NON_NEGATIVE
    assert isinstance(KEYS["n_iter"], Interval)


def _bad_calls():
    """One call per decorated public algorithm, with a bad hyper-parameter and inputs that no work
    could use (None): the bad value is refused first."""
    from bayesfuse.inference.bnn.fusion import fuse_bnn_posteriors
    from bayesfuse.inference.bnn.units import keep_informative
    from bayesfuse.inference.fedma import fedma, fedma_steps
    from bayesfuse.inference.klfusion import kl_fuse
    from bayesfuse.inference.layerwise import match_layerwise
    from bayesfuse.inference.matching import assignment_cost, log_marginal_posterior, match_neurons
    from bayesfuse.inference.otfusion import choose_anchor, ot_fuse_layerwise
    from bayesfuse.inference.relaxed import solve_relaxed
    from bayesfuse.inference.summary_fusion import fold_temperature

    return [
        ("match_neurons n_iter", lambda: match_neurons(None, n_iter=0), "n_iter must be"),
        ("match_neurons noise_var", lambda: match_neurons(None, noise_var="guess"), "noise_var must be"),
        ("match_neurons rounds", lambda: match_neurons(None, rounds=0), "rounds must be"),
        ("log_marginal_posterior", lambda: log_marginal_posterior(None, None, gamma0=0.0), "gamma0 must be"),
        ("assignment_cost", lambda: assignment_cost(None, None, None, None, None, None, cost="auto"), "cost must be"),
        ("match_layerwise", lambda: match_layerwise(None, None, direction="sideways"), "direction must be"),
        ("match_layerwise absent", lambda: match_layerwise(None, None, absent="none"), "absent must be"),
        ("fedma_steps", lambda: fedma_steps(None, None, kl_weight=-1.0), "kl_weight must be"),
        ("fedma", lambda: fedma(None, None, None, cost="hungarian"), "cost must be"),
        ("ot_fuse_layerwise", lambda: ot_fuse_layerwise(None, None, reg=-1.0), "reg must be"),
        ("choose_anchor", lambda: choose_anchor(None, None, "largest"), "anchor must be"),
        ("kl_fuse", lambda: kl_fuse(None, mode="both"), "mode must be"),
        ("kl_fuse cost_scale", lambda: kl_fuse(None, cost_scale=0.0), "cost_scale must be"),
        ("solve_relaxed", lambda: solve_relaxed(None, 1.0, solver="gurobi"), "solver must be"),
        ("fuse_bnn_posteriors", lambda: fuse_bnn_posteriors(None, None, unit_form="scaled"), "unit_form must be"),
        ("keep_informative", lambda: keep_informative(None, -1.0), "min_kl must be"),
        ("fold_temperature", lambda: fold_temperature(None, None, 0.0), "temperature must be"),
    ]


@pytest.mark.parametrize("name, call, match", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_each_public_algorithm_refuses_a_bad_value_before_any_work(name, call, match):
    with pytest.raises(InvalidParameterError, match=match):
        call()


def test_warnings_still_point_at_the_callers_line():
    from bayesfuse.inference.expfam import DiagNormal
    from bayesfuse.inference.klfusion import kl_fuse
    from bayesfuse.inference.result import ConvergenceWarning

    rng = np.random.default_rng(0)
    posteriors = [DiagNormal(loc=rng.normal(size=(4, 3)), var=np.full((4, 3), 0.1)) for _ in range(3)]
    with pytest.warns(ConvergenceWarning) as caught:
        kl_fuse(posteriors, n_iter=1)
    assert {w.filename for w in caught if w.category is ConvergenceWarning} == {__file__}
