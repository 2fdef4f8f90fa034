"""Permutation specs as data: shapes, checks and the global basis."""

import numpy as np
import pytest

from bayesfuse.inference.spec import Axis, PermutationSpec, chain, dense, permute, to_global_basis


def test_to_global_basis_places_units_and_marks_missing():
    a = np.arange(12.0).reshape(2, 3, 2)  # axis 1: 3 units, inner 2
    out = to_global_basis(a.reshape(2, 6), 1, Axis("P", inner=2), np.array([4, 0, 2]), 5)
    assert out.shape == (2, 10)
    blocks = out.reshape(2, 5, 2)
    np.testing.assert_array_equal(blocks[:, 4], a[:, 0])
    np.testing.assert_array_equal(blocks[:, 0], a[:, 1])
    assert np.isnan(blocks[:, [1, 3]]).all()


def test_spec_check_names_entry_and_shapes():
    spec = chain(dense("a", None, "P"), dense("b", "P", None))
    good = {"a.weight": np.zeros((5, 3)), "a.bias": np.zeros(5), "b.weight": np.zeros((2, 5)), "b.bias": np.zeros(2)}
    assert spec.sizes(good) == {"P": 5}
    bad = dict(good, **{"b.weight": np.zeros((2, 6))})
    with pytest.raises(ValueError, match=r"group P has 6 units in 'b.weight'"):
        spec.check(bad)
    with pytest.raises(ValueError, match="lacks entries"):
        spec.check({k: v for k, v in good.items() if k != "a.bias"})


# --------------------------------------------------------------------------- position encodings


def _pan_spec(mode="mul", after_bn=False):
    """``a -> [bn ->] PAN -> relu -> b``: one hidden group ``P`` with an encoding on ``a``'s (``bn``'s) outputs."""
    from dataclasses import replace

    from bayesfuse.inference.spec import Encoding, batchnorm

    parts = [dense("a", None, "P"), *([batchnorm("bn", "P", after="a")] if after_bn else []), dense("b", "P", None)]
    return replace(
        chain(*parts, output=("b.weight", "b.bias")),
        encodings={"P": Encoding(mode, 1.0, 0.3, after="bn" if after_bn else "a")},
    )


@pytest.mark.catalogue
def test_spec_json_round_trip_keeps_the_encodings():
    import json

    from bayesfuse.inference.spec import Encoding, spec_from_dict, spec_to_dict

    spec = _pan_spec("add", after_bn=True)
    data = json.loads(json.dumps(spec_to_dict(spec)))
    assert data["encodings"] == {"P": {"mode": "add", "period": 1.0, "amplitude": 0.3, "after": "bn"}}
    back = spec_from_dict(data)
    assert back == spec and back.encodings == {"P": Encoding("add", 1.0, 0.3, after="bn")}
    plain = chain(dense("a", None, "P"), dense("b", "P", None))
    assert "encodings" not in spec_to_dict(plain)  # plain networks' spec files stay as they were
    assert spec_from_dict(spec_to_dict(plain)).encodings == {}
    for bad, match in [
        ({"Q": {"mode": "mul"}}, "not among the groups"),
        ({"P": {"mode": "both"}}, "mode"),
        ({"P": {"mode": "mul", "amplitude": -1}}, "amplitude"),
        ({"P": {"width": 3}}, "unknown keys"),
        (["P"], "maps group names"),
    ]:
        with pytest.raises(ValueError, match=match):
            spec_from_dict({**data, "encodings": bad})


def _forward(state, spec, x, encoded):
    """``b(relu(pan(bn(a x))))`` in NumPy: the network a spec of :func:`_pan_spec` describes."""
    from bayesfuse.inference.encodings import position_encoding

    z = x @ state["a.weight"].T + state["a.bias"]
    if "bn.weight" in state:
        z = (
            state["bn.weight"] * (z - state["bn.running_mean"]) / np.sqrt(state["bn.running_var"] + 1e-5)
            + state["bn.bias"]
        )
    if encoded:
        enc = spec.encodings["P"]
        e = position_encoding(z.shape[1], enc)
        z = z * e if enc.mode == "mul" else z + e
    return np.maximum(z, 0) @ state["b.weight"].T + state["b.bias"]


@pytest.mark.parametrize("after_bn", [False, True])
@pytest.mark.parametrize("mode", ["mul", "add"])
def test_folding_encodings_keeps_the_function_and_unfolding_undoes_it(mode, after_bn):
    """Eq. F: the plain network computes what the encoded one does; eq. U at another width too."""
    from bayesfuse.inference.encodings import fold_encodings, unfold_encodings
    from bayesfuse.inference.spec import permute

    rng = np.random.default_rng(0)
    spec = _pan_spec(mode, after_bn)
    state = {
        "a.weight": rng.normal(size=(7, 4)),
        "a.bias": rng.normal(size=7),
        "b.weight": rng.normal(size=(3, 7)),
        "b.bias": rng.normal(size=3),
    }
    if after_bn:
        state.update(
            {
                "bn.weight": rng.normal(size=7),
                "bn.bias": rng.normal(size=7),
                "bn.running_mean": rng.normal(size=7),
                "bn.running_var": rng.uniform(0.5, 2, size=7),
                "bn.num_batches_tracked": np.array(3),
            }
        )
    x = rng.normal(size=(10, 4))
    plain = fold_encodings(state, spec)
    np.testing.assert_allclose(_forward(plain, spec, x, False), _forward(state, spec, x, True), rtol=1e-12, atol=1e-12)
    back = unfold_encodings(plain, spec)
    for k in state:
        np.testing.assert_allclose(back[k], state[k], rtol=1e-14, atol=1e-14)
    # the units in another order, and a dead unit more: the encodings of their new positions
    perm = rng.permutation(7)
    wider = {
        k: np.concatenate([v, np.ones(1)]) if v.ndim == 1 and v.shape == (7,) else v
        for k, v in permute(plain, spec, {"P": perm}).items()
    }
    wider["a.weight"] = np.vstack([wider["a.weight"], np.ones((1, 4))])
    wider["b.weight"] = np.hstack([wider["b.weight"], np.zeros((3, 1))])
    if after_bn:
        wider["bn.running_var"][-1] = 1.0
    np.testing.assert_allclose(
        _forward(unfold_encodings(wider, spec), spec, x, True), _forward(state, spec, x, True), rtol=1e-12, atol=1e-12
    )


@pytest.mark.catalogue
def test_multiplicative_encodings_with_a_zero_cannot_be_unfolded():
    from dataclasses import replace

    from bayesfuse.inference.encodings import check_unfoldable, unfold_encodings
    from bayesfuse.inference.spec import Encoding

    spec = _pan_spec("mul")
    check_unfoldable(spec)
    big = replace(spec, encodings={"P": Encoding("mul", 1.0, 1.0, after="a")})  # e_j = 1 + sin(2 pi j / J)
    with pytest.raises(ValueError, match="A=1.0 >= 1"):
        check_unfoldable(big)
    state = {"a.weight": np.ones((4, 2)), "a.bias": np.ones(4), "b.weight": np.ones((3, 4)), "b.bias": np.ones(3)}
    with pytest.raises(ValueError, match="vanishes"):
        unfold_encodings(state, big)
    check_unfoldable(replace(spec, encodings={"P": Encoding("add", 1.0, 5.0, after="a")}))  # add: any amplitude


def test_spec_json_round_trip_keeps_the_widths_a_forward_fixes():
    import dataclasses
    import json

    from bayesfuse.inference.spec import spec_from_dict, spec_to_dict

    plain = chain(dense("a", None, "P"), dense("b", "P", None))
    fixed = dataclasses.replace(plain, fixed={"P": "its forward cuts them by split(4)"})
    assert "fixed" not in spec_to_dict(plain)
    assert spec_from_dict(json.loads(json.dumps(spec_to_dict(fixed)))) == fixed
    with pytest.raises(ValueError, match="'fixed' maps groups it lists"):
        dataclasses.replace(plain, fixed={"Q": "why"})
    with pytest.raises(ValueError, match="gives the units of P another width"):
        fixed.check_free_widths("pfnm")
    plain.check_free_widths("pfnm")  # nothing fixed: nothing refused
    fixed.check_fixed_kept("pfnm", {"P": 8}, {"P": 8})  # held at its width
    fixed.check_fixed_kept("pfnm", {"P": 8}, {"Q": 8}, {"P": "Q"})  # fused as the group it was tied into
    with pytest.raises(ValueError, match=r"method='fedma' gave the units of P 9 units instead of 8"):
        fixed.check_fixed_kept("fedma", {"P": 8}, {"P": 9})


def test_spec_json_round_trip_keeps_the_widths_modules_hold():
    import dataclasses
    import json

    from bayesfuse.inference.spec import spec_from_dict, spec_to_dict

    plain = chain(dense("a", None, "P"), dense("b", "P", None))
    held = dataclasses.replace(plain, widths={"width": "P", "attn.dims": Axis("P", outer=3)})
    assert held.widths == {"width": Axis("P"), "attn.dims": Axis("P", outer=3)}
    assert "widths" not in spec_to_dict(plain)
    assert spec_from_dict(json.loads(json.dumps(spec_to_dict(held)))) == held
    # at the state's widths: P has 5 units in a's rows
    state = {"a.weight": np.zeros((5, 2)), "a.bias": np.zeros(5), "b.weight": np.zeros((1, 5)), "b.bias": np.zeros(1)}
    assert held.held_widths(state) == {"width": 5, "attn.dims": 15}
    with pytest.raises(ValueError, match="group 'Q', which is not among the groups"):
        dataclasses.replace(plain, widths={"width": "Q"})
    for bad in ("", "a.", "a..b", ".a", "3", "a.3", "_w.x y"):
        with pytest.raises(ValueError, match="maps module attributes"):
            dataclasses.replace(plain, widths={bad: "P"})
    for good in ("blocks.0.attn.head_dim", "blocks.block-1.width"):  # an nn.ModuleDict's key is any name
        assert list(dataclasses.replace(plain, widths={good: "P"}).widths) == [good]


def test_spec_json_round_trip_keeps_entries_tied_and_checks_them():
    import dataclasses
    import json

    from bayesfuse.inference.spec import spec_from_dict, spec_to_dict

    plain = chain(dense("a", None, "P"), dense("b", "P", "Q"), dense("c", "Q", None))
    axes = {**plain.axes, "a2.weight": plain.axes["a.weight"]}
    tied = PermutationSpec(axes, plain.groups, output=plain.output, tied={"a2.weight": "a.weight"})
    assert "tied" not in spec_to_dict(plain)
    assert spec_from_dict(json.loads(json.dumps(spec_to_dict(tied)))) == tied
    fused = {"a.weight": np.ones((3, 2)), "a2.weight": np.zeros((3, 2)), "b.bias": np.zeros(4)}
    retied = tied.retie(fused)
    assert retied["a2.weight"] is fused["a.weight"] and retied["b.bias"] is fused["b.bias"]
    assert list(tied.retie({"b.bias": fused["b.bias"]})) == ["b.bias"]  # neither held: as it is
    for bad, why in [
        ({"a.weight": "a.weight"}, "maps an entry to another entry's name"),
        ({"a3.weight": "a.weight"}, "its axes do not describe both"),
        ({"b.weight": "a.weight"}, "but gives them different axes"),
        ({"a2.weight": "a.weight", "a.weight": "a2.weight"}, "which is tied to another entry itself"),
    ]:
        with pytest.raises(ValueError, match=why):
            dataclasses.replace(tied, tied=bad)


def test_entries_in_pieces_split_join_permute_and_round_trip_through_json():
    """An entry reading the input beside a group's units (``cat([x, h])``): split into its pieces
    at any width, joined back exactly, permuted piece by piece, kept by the spec's JSON."""
    import dataclasses
    import json

    from bayesfuse.inference.spec import spec_from_dict, spec_to_dict

    spec = PermutationSpec(
        {"a.weight": ("P", None), "a.bias": ("P",), "b.weight@0": (None, None), "b.weight@1": (None, "P")},
        ("P",),
        output=("b.weight@0", "b.weight@1"),
        pieces={"b.weight": (1, (("b.weight@0", 3), ("b.weight@1", None)))},
    )
    rng = np.random.default_rng(0)
    for width in (4, 7):
        state = {
            "a.weight": rng.normal(size=(width, 3)),
            "a.bias": rng.normal(size=width),
            "b.weight": rng.normal(size=(2, 3 + width)),
        }
        pieces = spec.split(state)
        assert list(pieces) == ["a.weight", "a.bias", "b.weight@0", "b.weight@1"] and spec.sizes(state) == {"P": width}
        assert np.array_equal(pieces["b.weight@1"], state["b.weight"][:, 3:]) and spec.whole("b.weight@1") == "b.weight"
        assert all(np.array_equal(spec.join(pieces)[k], state[k]) for k in state)
        perm = rng.permutation(width)
        moved = permute(state, spec, {"P": perm})
        assert np.array_equal(
            moved["b.weight"], np.hstack([state["b.weight"][:, :3], state["b.weight"][:, 3:][:, perm]])
        )
        assert np.array_equal(moved["a.weight"], state["a.weight"][perm])
    assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))) == spec
    with pytest.raises(ValueError, match="a piece that no group permutes along 1 has a length >= 1"):
        PermutationSpec(spec.axes, ("P",), pieces={"b.weight": (1, (("b.weight@0", None), ("b.weight@1", None)))})
    with pytest.raises(ValueError, match="'b.weight' is described by its pieces, at least two"):
        PermutationSpec({**spec.axes, "b.weight": (None, None)}, ("P",), pieces=spec.pieces)
    whole = {"a.weight": np.zeros((4, 3)), "a.bias": np.zeros(4), "b.weight": np.zeros((2, 7)), "b.bias": np.zeros(2)}
    spec = dataclasses.replace(spec, axes={**spec.axes, "b.bias": (None,)}, output=(*spec.output, "b.bias"))
    assert spec.output_layer(whole) == ("b.weight", "b.bias")  # the output layer, read whole
    with pytest.raises(ValueError, match=r"the output layer's 'b.weight' is read whole: join its pieces first"):
        spec.output_layer(spec.split(whole))


def test_transposed_convolutions_have_their_units_on_axis_1_and_round_trip_through_json():
    """``conv(..., transposed=True)``: the weight ``(C_in, C_out, k)`` holds the layer's units on
    axis 1 (:meth:`rows_dim`); a batch norm after it folds along that axis, and the spec's JSON
    keeps it. A weight the spec does not describe cannot be named transposed."""
    import dataclasses
    import json

    from bayesfuse.inference.layerwise import fold_batchnorm
    from bayesfuse.inference.spec import batchnorm, conv, spec_from_dict, spec_to_dict

    spec = chain(
        conv("a", None, "P", ndim=1),
        conv("up", "P", "Q", ndim=1, transposed=True),
        batchnorm("bn", "Q", after="up"),
        conv("out", "Q", None, ndim=1),
        output=("out.weight", "out.bias"),
    )
    assert spec.transposed == ("up.weight",) and spec.axes["up.weight"] == (Axis("P"), Axis("Q"), None)
    assert (spec.rows_dim("up.weight"), spec.rows_dim("up.bias"), spec.rows_dim("a.weight")) == (1, 0, 0)
    assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))) == spec
    assert "transposed" not in spec_to_dict(dataclasses.replace(spec, transposed=()))
    rng = np.random.default_rng(0)
    state = {
        "a.weight": rng.normal(size=(4, 2, 3)),
        "a.bias": rng.normal(size=4),
        "up.weight": rng.normal(size=(4, 5, 2)),
        "up.bias": rng.normal(size=5),
        "bn.weight": rng.normal(size=5),
        "bn.bias": rng.normal(size=5),
        "bn.running_mean": rng.normal(size=5),
        "bn.running_var": rng.uniform(0.5, 2.0, size=5),
        "bn.num_batches_tracked": np.array(3),
        "out.weight": rng.normal(size=(3, 5, 1)),
        "out.bias": rng.normal(size=3),
    }
    folded = fold_batchnorm(state, spec)
    scale = state["bn.weight"] / np.sqrt(state["bn.running_var"] + 1e-5)
    np.testing.assert_allclose(folded["up.weight"], state["up.weight"] * scale[None, :, None])
    for bad in (["nope.weight"], ["up.bias"], "up.weight"):
        with pytest.raises(ValueError, match="'transposed'"):
            dataclasses.replace(spec, transposed=bad)
    axes = {k: v for k, v in spec.axes.items() if k != "up.weight"}  # it reads P beside 2 input channels
    axes.update({"up.weight@0": spec.axes["up.weight"], "up.weight@1": (None, Axis("Q"), None)})
    cut = dataclasses.replace(spec, axes=axes, pieces={"up.weight": (0, (("up.weight@0", None), ("up.weight@1", 2)))})
    assert cut.rows_dim("up.weight@0") == 1  # a piece of a transposed weight: as the weight
    with pytest.raises(ValueError, match="names the piece 'up.weight@0'"):
        dataclasses.replace(cut, transposed=("up.weight@0",))
