"""Checkpoint files: entry order, tensor digests, output formats and clear read errors."""

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from bayesfuse.checkpoints import load_state_dict, output_format, read_checkpoint, save_state_dict, tensors_sha256
from bayesfuse.inference.spec import entry_order
from bayesfuse.models.bnn import HorseshoeBNN


def _mlp(widths, names=None, seed=0):
    """A plain MLP state_dict with layers ``names`` (default l0, l1, ...) of the given widths."""
    g = torch.Generator().manual_seed(seed)
    names = names or [f"l{i}" for i in range(len(widths) - 1)]
    sd = {}
    for name, (d, h) in zip(names, zip(widths[:-1], widths[1:])):
        sd[f"{name}.weight"] = torch.randn(h, d, generator=g)
        sd[f"{name}.bias"] = torch.randn(h, generator=g)
    return sd


# --------------------------------------------------------------------------- entry order


def _widths(widths):
    return {k: tuple(v.shape) for k, v in _mlp(widths, ["input", "hidden", "output"]).items()}


def test_a_lost_order_comes_from_the_shapes_when_one_chain_fits():
    sd = _mlp([6, 8, 5, 3], ["input", "hidden", "output"])
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    assert entry_order(sorted(sd), shapes) == list(sd)
    with pytest.raises(
        ValueError,
        match=r"f\.safetensors: the file does not record the order.* 2 different orders"
        r".*spec_path=",
    ):
        entry_order(sorted(sd), _widths([8, 8, 8, 3]), "f.safetensors")  # D == H: input and hidden swap
    with pytest.raises(ValueError, match="chain in no order"):
        entry_order(sorted(sd), dict(shapes, **{"output.weight": (3, 7)}))
    conv = {"c.weight": (4, 3, 3, 3), "c.bias": (4,), "fc.weight": (2, 4), "fc.bias": (2,)}
    assert entry_order(sorted(conv), conv) == ["c.bias", "c.weight", "fc.bias", "fc.weight"]  # names only


def test_chain_orders_are_counted_exactly():
    """The count (none, one, several) agrees with trying every order of small random networks."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        m = int(rng.integers(1, 6))
        shapes = {f"l{i}.weight": tuple(int(w) for w in rng.integers(2, 5, 2)) for i in range(m)}
        keys = list(shapes)
        chains = [
            p for p in itertools.permutations(keys) if all(shapes[a][0] == shapes[b][1] for a, b in zip(p[:-1], p[1:]))
        ]
        if len(chains) == 1:
            assert entry_order(keys, shapes) == list(chains[0])
        else:
            with pytest.raises(ValueError, match="no order" if not chains else f" {len(chains)} different orders"):
                entry_order(keys, shapes)


def _header_with(path, metadata):
    save_file(_mlp([6, 8, 5, 3], ["input", "hidden", "output"]), path, metadata=metadata)
    return path


@pytest.mark.catalogue
@pytest.mark.parametrize(
    "order",
    [
        "not json",
        json.dumps({"input.weight": 0}),
        json.dumps(["input.weight", 1, "input.bias"]),
        json.dumps(["input.weight", "input.bias"]),
        json.dumps(["input.weight"] * 6),
        json.dumps(["input.weight", "input.bias", "hidden.weight", "hidden.bias", "output.weight", "nope"]),
    ],
)
def test_order_metadata_that_is_malformed_or_lies_is_not_trusted(tmp_path, order):
    path = _header_with(tmp_path / "m.safetensors", {"bayesfuse.order": order})
    checkpoint = read_checkpoint(path)
    assert not checkpoint.order_recorded
    assert list(checkpoint.tensors) == sorted(checkpoint.tensors)


def test_order_metadata_is_trusted_when_it_names_every_entry(tmp_path):
    sd = _mlp([6, 8, 5, 3], ["input", "hidden", "output"])
    assert read_checkpoint(save_state_dict(sd, tmp_path / "ours.safetensors")).order_recorded
    assert list(load_state_dict(tmp_path / "ours.safetensors")) == list(sd)
    save_file(sd, tmp_path / "theirs.safetensors")
    assert not read_checkpoint(tmp_path / "theirs.safetensors").order_recorded
    assert read_checkpoint(save_state_dict(sd, tmp_path / "m.pt")).order_recorded


# --------------------------------------------------------------------------- digests


def test_tensor_digest_ignores_file_name_and_format(tmp_path):
    sd = _mlp([6, 8, 3])
    torch.save(sd, tmp_path / "alice.pt")  # torch's zip format stores the file's stem
    torch.save(sd, tmp_path / "bob.pt")
    save_state_dict(sd, tmp_path / "carol.safetensors")
    checkpoints = [read_checkpoint(tmp_path / n) for n in ("alice.pt", "bob.pt", "carol.safetensors")]
    assert checkpoints[0].sha256 != checkpoints[1].sha256
    assert len({tensors_sha256(c.tensors) for c in checkpoints}) == 1
    changed = dict(sd, **{"l1.bias": sd["l1.bias"].clone()})
    changed["l1.bias"][0] += 1e-6
    assert tensors_sha256(changed) != tensors_sha256(sd)
    assert tensors_sha256({k: v.double() for k, v in sd.items()}) != tensors_sha256(sd)
    assert tensors_sha256({k.replace("l1", "out"): v for k, v in sd.items()}) != tensors_sha256(sd)
    assert tensors_sha256(dict(reversed(list(sd.items())))) != tensors_sha256(sd)


# --------------------------------------------------------------------------- output format


@pytest.mark.catalogue
@pytest.mark.parametrize(
    "path, fmt, message",
    [
        ("fused.pt", "safetensors", "named like a pt file but the format asked for is safetensors"),
        ("fused.safetensors", "pt", "named like a safetensors file but the format asked for is pt"),
        ("fused.txt", None, "cannot tell the output format from 'fused.txt'"),
        ("fused", None, "cannot tell the output format"),
        ("", None, "is not a file name"),
        ("out/", "pt", "is not a file name"),
        ("fused.pt", "onnx", "unknown output format 'onnx'"),
    ],
)
def test_output_format_and_suffix_must_agree(tmp_path, path, fmt, message):
    with pytest.raises(ValueError, match=message):
        output_format(path, fmt)
    with pytest.raises(ValueError, match=message):
        save_state_dict(_mlp([2, 2]), f"{tmp_path}{os.sep}{path}" if path else path, fmt=fmt)
    assert not any(tmp_path.iterdir())


def test_output_format_from_suffix_or_fmt():
    assert output_format("a.PT") == "pt" and output_format("a.pth", "pt") == "pt"
    assert output_format("a.safetensors") == "safetensors"
    assert output_format("a.bin", "safetensors") == "safetensors"  # an unknown suffix with a format is fine


# --------------------------------------------------------------------------- read errors


@pytest.mark.catalogue
def test_empty_file_directory_and_sparse_entries_are_named(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.pt: the file is empty \(0 bytes\)"):
        read_checkpoint(tmp_path / "empty.pt")
    (tmp_path / "models.pt").mkdir()
    with pytest.raises(IsADirectoryError, match=r"models\.pt is a directory"):
        read_checkpoint(tmp_path / "models.pt")
    sd = _mlp([4, 3, 2])
    sd["l0.weight"] = sd["l0.weight"].to_sparse()
    torch.save(sd, tmp_path / "sparse.pt")
    with pytest.raises(ValueError, match=r"sparse\.pt: entry 'l0\.weight' is a sparse .*to_dense\(\)"):
        read_checkpoint(tmp_path / "sparse.pt")


@pytest.mark.catalogue
def test_entries_without_numbers_or_of_unread_dtypes_are_named(tmp_path):
    sd = _mlp([4, 3, 2])
    torch.save({k: torch.empty(v.shape, device="meta") for k, v in sd.items()}, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match=r"meta\.pt: entry 'l0\.weight' is a meta tensor"):
        read_checkpoint(tmp_path / "meta.pt")
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in sd.items()}, str(tmp_path / "f8.safetensors"))
    with pytest.raises(ValueError, match=r"f8\.safetensors: entry 'l0\.(weight|bias)' is float8_e4m3fn.*float32"):
        read_checkpoint(tmp_path / "f8.safetensors")
    (tmp_path / "notes.pth").write_text("hello world")
    with pytest.raises(ValueError, match=r"notes\.pth: .*KeyError: 101"):  # torch's KeyError(101), said as one
        read_checkpoint(tmp_path / "notes.pth")


@pytest.mark.catalogue
def test_tied_weights_are_saved_as_safetensors(tmp_path):
    weight = torch.randn(5, 3)
    path = save_state_dict({"embed.weight": weight, "head.weight": weight}, tmp_path / "tied.safetensors")
    back = read_checkpoint(path).tensors
    assert torch.equal(back["embed.weight"], weight) and torch.equal(back["head.weight"], weight)


@pytest.mark.catalogue
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_is_named(tmp_path):
    path = save_state_dict(_mlp([4, 3, 2]), tmp_path / "locked.pt")
    path.chmod(0)
    try:
        with pytest.raises(PermissionError, match=r"locked\.pt: permission denied .*chmod u\+r") as info:
            read_checkpoint(path)
        assert len(str(info.value).splitlines()) == 1
    finally:
        path.chmod(0o600)


@pytest.mark.catalogue
@pytest.mark.parametrize(
    "error, message",
    [
        (MemoryError(), r"huge\.safetensors: the model file \([\d,]+ bytes\) is too large to read into memory"),
        (PermissionError(13, "Permission denied"), r"huge\.safetensors: permission denied reading the model file"),
        (OSError(5, "Input/output error"), r"huge\.safetensors: cannot read the model file \(Input/output error\)"),
    ],
)
def test_read_failures_keep_their_kind_and_name_the_file(tmp_path, monkeypatch, error, message):
    path = save_state_dict(_mlp([4, 3, 2]), tmp_path / "huge.safetensors")

    def fail(self):
        raise error

    monkeypatch.setattr(Path, "read_bytes", fail)
    with pytest.raises(type(error), match=message) as info:
        read_checkpoint(path)
    assert len(str(info.value).splitlines()) == 1


# --------------------------------------------------------------------------- HorseshoeBNN checkpoints


@pytest.mark.catalogue
@pytest.mark.parametrize(
    "scales, message",
    [
        ([0.1, 1.0, 2.0], r"'prior_scales' has shape \(3,\)"),
        ([-0.1, 1.0], "two positive finite numbers"),
        ([0.1, float("nan")], "two positive finite numbers"),
        ([0.1, float("inf")], "two positive finite numbers"),
    ],
)
def test_bad_prior_scales_are_named(scales, message):
    state = HorseshoeBNN(5, 4, 3).state_dict()
    state["prior_scales"] = torch.tensor(scales, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"client\.pt: .*" + message):
        HorseshoeBNN.from_state_dict(state, "client.pt")


# --------------------------------------------------------------------------- what a training loop saves


def test_a_checkpoint_dict_gives_the_one_state_dict_it_holds(tmp_path):
    sd = _mlp([6, 4, 3])
    for key in ("model_state_dict", "state_dict", "model", "net"):
        path = tmp_path / f"{key}.pt"
        torch.save({key: sd, "epoch": 60, "optimizer_state_dict": {"state": {}, "lr": 0.1}}, path)
        checkpoint = read_checkpoint(path)
        assert checkpoint.state_dict_key == key and list(checkpoint.tensors) == list(sd)
        assert all(torch.equal(checkpoint.tensors[k], sd[k]) for k in sd)
    torch.save(sd, tmp_path / "plain.pt")
    assert read_checkpoint(tmp_path / "plain.pt").state_dict_key is None


@pytest.mark.parametrize(
    "content, message",
    [
        (
            {"model_state_dict": "SD", "ema_state_dict": "SD", "state_dict": "SD"},
            "two.pt: a checkpoint dict with several state_dicts (model_state_dict, state_dict); save the one to fuse on "
            "its own, torch.save(checkpoint['model_state_dict'], 'two.pt')",
        ),
        (
            {"epoch": 60, "weights": [1.0, 2.0]},
            "two.pt: a dict of epoch, weights, not a state_dict, and no entry of it (model_state_dict, state_dict, model, "
            "net, network, model_state) holds one; save the model's weights alone, torch.save(model.state_dict(), 'two.pt')",
        ),
        ([1, 2], "two.pt: expected a state_dict (a mapping of parameter names to tensors), got a list"),
        ({}, "got an empty dict"),
    ],
)
def test_a_checkpoint_dict_without_exactly_one_state_dict_is_refused_with_the_fix(tmp_path, content, message):
    sd = _mlp([6, 4, 3])
    if isinstance(content, dict):
        content = {k: sd if v == "SD" else v for k, v in content.items()}
    torch.save(content, tmp_path / "two.pt")
    with pytest.raises(ValueError) as info:
        read_checkpoint(tmp_path / "two.pt")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_pickled_module_is_named_with_the_line_that_saves_its_state_dict(tmp_path):
    torch.save(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)), tmp_path / "m.pt")
    torch.save({"model": torch.nn.Linear(4, 3), "epoch": 2}, tmp_path / "inside.pt")
    with pytest.raises(ValueError) as whole:
        read_checkpoint(tmp_path / "m.pt")
    assert str(whole.value) == (
        f"{tmp_path / 'm.pt'}: a pickled torch.nn.modules.container.Sequential object (torch.save(model) saves the "
        "whole module, code and all), not a state_dict; save the weights alone, torch.save(model.state_dict(), "
        "'m.pt'), and fuse that file"
    )
    with pytest.raises(ValueError) as inside:
        read_checkpoint(tmp_path / "inside.pt")
    assert (
        "inside.pt: holds a pickled torch.nn.modules.linear.Linear object, which torch.load(weights_only=True) refuses"
    ) in str(inside.value) and "model.state_dict()" in str(inside.value)
    for err in (whole.value, inside.value):
        assert "\x1b" not in str(err) and "\n" not in str(err)


def test_torch_s_own_message_comes_without_escape_codes(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"\x00\x01 not a checkpoint")
    with pytest.raises(ValueError) as info:
        read_checkpoint(tmp_path / "garbage.pt")
    text = str(info.value)
    assert text.startswith(
        f"{tmp_path / 'garbage.pt'}: not a plain state_dict checkpoint (torch.load with "
        "weights_only=True failed: Weights only load failed: Unsupported operand"
    )
    assert "\x1b" not in text and "\n" not in text and "torch.save(model.state_dict(), 'garbage.pt')" in text


def test_escape_codes_in_torch_s_message_are_dropped(tmp_path, monkeypatch):
    import bayesfuse.checkpoints as checkpoints

    def coloured(*args, **kwargs):
        raise RuntimeError(
            "Weights only load failed. \x1b[1mdo those steps only if you trust the source\x1b[0m.\n"
            "Unsupported global: \x1b[31mGLOBAL\x1b[0m"
        )

    monkeypatch.setattr(checkpoints.torch, "load", coloured)
    save_state_dict(_mlp([6, 4, 3]), tmp_path / "m.pt")
    with pytest.raises(ValueError) as info:
        read_checkpoint(tmp_path / "m.pt")
    assert "failed: Weights only load failed: Unsupported global: GLOBAL)" in str(info.value)
    assert "\x1b" not in str(info.value)


def test_a_heads_file_keeps_the_kronecker_posterior_and_its_scales(tmp_path):
    """The heads file stores each Gram at its support only; everything, the trace-matched scales
    included, comes back exactly (float64)."""
    from bayesfuse.checkpoints import heads_bytes, read_heads

    rng = np.random.default_rng(0)
    J, K, G = 2, 3, 4
    support = np.array([[1, 0, 1, 1, 1], [0, 1, 1, 0, 1]], dtype=float)
    gram = np.zeros((J, G + 1, G + 1))
    for j, at in enumerate(support > 0):
        a = rng.normal(size=(at.sum(), at.sum()))
        gram[j][np.ix_(at, at)] = a @ a.T
    laplace = dict(
        gram=gram,
        curvature=np.tile(np.eye(K), (J, 1, 1)),
        n=np.array([5.0, 7.0]),
        prior_precision=np.array([1.0, 0.5]),
        support=support,
        scale=np.array([0.6, 1.3]),
    )
    heads = dict(
        output="layers.1",
        weight=rng.normal(size=(J, K, G)),
        bias=rng.normal(size=(J, K)),
        shares=np.full((J, K), 0.5),
        form="kronecker",
        laplace=laplace,
    )
    model = {"layers.1.weight": torch.zeros(K, G)}
    path = tmp_path / "fused.pt.heads.safetensors"
    path.write_bytes(heads_bytes(heads, pool="log", model_tensors=model))
    back, pool = read_heads(path, model, "fused.pt")
    assert pool == "log" and back["form"] == "kronecker" and set(back["laplace"]) == set(laplace)
    for key, value in laplace.items():
        np.testing.assert_array_equal(back["laplace"][key], value)
    assert back["examples"] is None  # no class counts: no smoothing
    heads["examples"] = np.array([30.0, 12.0])
    path.write_bytes(heads_bytes(heads, pool="log", model_tensors=model))
    np.testing.assert_array_equal(read_heads(path, model, "fused.pt")[0]["examples"], [30.0, 12.0])


def test_heads_of_an_unknown_form_are_refused():
    from bayesfuse.checkpoints import heads_from_arrays

    with pytest.raises(ValueError, match="h.safetensors: unknown form of the client heads 'bogus'"):
        heads_from_arrays({}, "fc", "bogus", "h.safetensors")


def test_a_version_1_heads_file_is_read_without_smoothing(tmp_path):
    """Heads files written before the examples were kept (version 1) still load; their heads know
    no examples, so they predict unsmoothed, as they did. An unknown version is refused."""
    from safetensors.numpy import save

    from bayesfuse.checkpoints import HEADS_FORMAT, read_heads, tensors_sha256

    K, G = 3, 4
    model = {"layers.1.weight": torch.zeros(K, G)}
    tensors = {"weight": np.ones((2, K, G)), "bias": np.zeros((2, K)), "shares": np.full((2, K), 0.5)}
    for version, ok in (("1", True), ("4", False)):
        meta = dict(format=HEADS_FORMAT, version=version, output="layers.1", form="map", pool="log")
        meta["model_tensors_sha256"] = tensors_sha256(model)
        path = tmp_path / f"v{version}.heads.safetensors"
        path.write_bytes(save(tensors, metadata=meta))
        if ok:
            assert read_heads(path, model, "fused.pt")[0]["examples"] is None
        else:
            with pytest.raises(ValueError, match=r"version '4' is not one this bayesfuse reads \(1, 2, 3\)"):
                read_heads(path, model, "fused.pt")


def test_a_hashed_state_is_digested_once_and_as_a_plain_one():
    """``bayesfuse.load`` checks the digest of one file's tensors against its report and each
    side file: a HashedState computes it once (the digest a plain dict of the same tensors has)."""
    from unittest import mock

    from bayesfuse import checkpoints

    state = {"a.weight": torch.randn(3, 4), "a.bias": torch.zeros(3, dtype=torch.float64)}
    plain = checkpoints.tensors_sha256(state)
    hashed = checkpoints.HashedState(state)
    with mock.patch.object(checkpoints.hashlib, "sha256", wraps=checkpoints.hashlib.sha256) as sha:
        assert [checkpoints.tensors_sha256(hashed) for _ in range(4)] == [plain] * 4
    assert sha.call_count == 1
