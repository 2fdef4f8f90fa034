"""A catalogue of bad inputs across the API and the CLI: each fails clearly and leaves nothing behind."""

import json
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file
from torch import nn

from bayesfuse import fuse, fuse_states
from bayesfuse.checkpoints import load_state_dict, save_state_dict
from bayesfuse.cli import main
from bayesfuse.data import Dataset, dirichlet_partition
from bayesfuse.inference.expfam import DiagNormal, Gamma
from bayesfuse.inference.fedma import fedma
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.matching import match_neurons
from bayesfuse.models.bnn import HorseshoeBNN
from bayesfuse.nets import MLP
from bayesfuse.nets.arch import make_cnn
from bayesfuse.nets.pans import PANConfig
from bayesfuse.nets.spec import UnsupportedLayerError
from bayesfuse.nets.state import numpy_state
from bayesfuse.train import TrainConfig

pytestmark = pytest.mark.catalogue


def _mlp_sd(d=6, h=4, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(h, d, generator=g),
        "fc1.bias": torch.randn(h, generator=g),
        "fc2.weight": torch.randn(k, h, generator=g),
        "fc2.bias": torch.randn(k, generator=g),
    }


@pytest.fixture
def files(tmp_path):
    good = [save_state_dict(_mlp_sd(seed=s), tmp_path / f"good{s}.pt") for s in range(2)]
    bad = {}
    (tmp_path / "notes.txt").write_text("hello")
    bad["text file"] = tmp_path / "notes.txt"
    (tmp_path / "garbage.pt").write_bytes(b"\x00\x01 not a checkpoint")
    bad["garbage .pt"] = tmp_path / "garbage.pt"
    truncated = good[0].read_bytes()
    (tmp_path / "truncated.pt").write_bytes(truncated[: len(truncated) // 2])
    bad["truncated"] = tmp_path / "truncated.pt"
    with open(tmp_path / "pickled.pt", "wb") as fh:  # weights_only must refuse arbitrary objects
        pickle.dump({"fc1.weight": torch.zeros(2, 2), "extra": MLP(2, [2], 2)}, fh)
    bad["pickled object"] = tmp_path / "pickled.pt"
    nan = _mlp_sd()
    nan["fc1.weight"][0, 0] = float("nan")
    bad["nan weights"] = save_state_dict(nan, tmp_path / "nan.pt")
    bad["other classes"] = save_state_dict(_mlp_sd(k=5), tmp_path / "k5.pt")
    bad["other inputs"] = save_state_dict(_mlp_sd(d=7), tmp_path / "d7.pt")
    zero = _mlp_sd(h=4)
    zero["fc1.weight"], zero["fc1.bias"], zero["fc2.weight"] = torch.zeros(0, 6), torch.zeros(0), torch.zeros(3, 0)
    bad["zero width"] = save_state_dict(zero, tmp_path / "zero.pt")
    renamed = {k.replace("fc", "dense"): v for k, v in _mlp_sd().items()}
    bad["other names"] = save_state_dict(renamed, tmp_path / "renamed.pt")
    nobias = _mlp_sd()
    del nobias["fc1.bias"]
    bad["missing bias"] = save_state_dict(nobias, tmp_path / "nobias.pt")
    (tmp_path / "weights.h5").write_bytes(b"x")
    bad["unknown suffix"] = tmp_path / "weights.h5"
    (tmp_path / "empty.pt").write_bytes(b"")
    bad["empty .pt"] = tmp_path / "empty.pt"
    (tmp_path / "models.pt").mkdir()
    bad["a directory"] = tmp_path / "models.pt"
    sparse = _mlp_sd()
    sparse["fc1.weight"] = sparse["fc1.weight"].to_sparse()
    torch.save(sparse, tmp_path / "sparse.pt")
    bad["sparse entry"] = tmp_path / "sparse.pt"
    # safetensors files of another tool record no entry order; D == H: input and hidden swap
    square = {
        "input.weight": torch.ones(6, 6),
        "input.bias": torch.ones(6),
        "hidden.weight": torch.ones(6, 6),
        "hidden.bias": torch.ones(6),
        "output.weight": torch.ones(3, 6),
        "output.bias": torch.ones(3),
    }
    save_file(square, tmp_path / "unordered.safetensors")
    bad["ambiguous order"] = tmp_path / "unordered.safetensors"
    for case, order in [("order metadata with ints", ["input.weight", 1]), ("order metadata lies", ["a", "b"])]:
        save_file(square, tmp_path / f"{case}.safetensors", metadata={"bayesfuse.order": json.dumps(order)})
        bad[case] = tmp_path / f"{case}.safetensors"
    save_file(dict(square, **{"output.weight": torch.ones(3, 5)}), tmp_path / "nochain.safetensors")
    bad["no chain"] = tmp_path / "nochain.safetensors"
    # what training loops save: a whole module, or a dict around the state_dict
    torch.save(nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3)), tmp_path / "module.pt")
    bad["pickled module"] = tmp_path / "module.pt"
    torch.save({"model": MLP(6, [4], 3), "epoch": 60}, tmp_path / "module_inside.pt")
    bad["module in a dict"] = tmp_path / "module_inside.pt"
    torch.save(
        {"model_state_dict": _mlp_sd(), "ema_state_dict": _mlp_sd(seed=1), "state_dict": _mlp_sd(seed=2)},
        tmp_path / "two_states.pt",
    )
    bad["two state_dicts"] = tmp_path / "two_states.pt"
    torch.save({"epoch": 60, "weights": [_mlp_sd()["fc1.weight"]]}, tmp_path / "no_state.pt")
    bad["dict without a state_dict"] = tmp_path / "no_state.pt"
    return good, bad


CLI_CASES = [
    ("text file", "unknown model file type"),
    ("garbage .pt", "not a plain state_dict"),
    ("truncated", "not a plain state_dict"),
    ("pickled object", "weights_only"),
    ("nan weights", "NaN"),
    ("other classes", "has 5 classes in 'fc2.weight'"),
    ("other inputs", "differ beyond hidden widths"),
    ("zero width", "zero width"),
    ("other names", "lacks entries"),
    ("missing bias", "no matching bias"),
    ("unknown suffix", "unknown model file type"),
    ("empty .pt", "empty.pt: the file is empty (0 bytes)"),
    ("a directory", "models.pt is a directory, not a model file"),
    (
        "sparse entry",
        "sparse.pt: entry 'fc1.weight' is a sparse (torch.sparse_coo) tensor; save dense tensors (tensor.to_dense()",
    ),
    (
        "ambiguous order",
        "unordered.safetensors: the file does not record the order of its layers, and their shapes "
        "chain in 2 different orders",
    ),
    ("ambiguous order", "give the architecture as a spec (--arch-spec FILE)"),
    ("order metadata with ints", "chain in 2 different orders"),
    ("order metadata lies", "chain in 2 different orders"),
    ("no chain", "nochain.safetensors: its Linear layers chain in no order"),
    (
        "pickled module",
        "module.pt: a pickled torch.nn.modules.container.Sequential object (torch.save(model) saves "
        "the whole module, code and all), not a state_dict; save the weights alone, "
        "torch.save(model.state_dict(), 'module.pt'), and fuse that file",
    ),
    (
        "module in a dict",
        "module_inside.pt: holds a pickled bayesfuse.nets.mlp.MLP object, which torch.load(weights_only=True) refuses",
    ),
    (
        "two state_dicts",
        "two_states.pt: a checkpoint dict with several state_dicts (model_state_dict, state_dict); "
        "save the one to fuse on its own, torch.save(checkpoint['model_state_dict'], 'two_states.pt')",
    ),
    ("dict without a state_dict", "no_state.pt: a dict of epoch, weights, not a state_dict"),
]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("case, message", CLI_CASES)
def test_cli_rejects_bad_files(files, tmp_path, capsys, case, message):
    good, bad = files
    out = tmp_path / "fused.pt"
    assert main(["fuse", str(good[0]), str(bad[case]), "--method", "pfnm", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists() and not (tmp_path / "fused.pt.json").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "fedma"], "needs the clients' data"),
        (["--method", "magic"], "unknown method 'magic'"),
        (["--method", "pfnm", "--hyper", "sigma=2"], "unknown hyper-parameter 'sigma'"),
        (["--method", "pfnm", "--hyper", "noise_var"], "key=value"),
        (["--method", "pfnm", "--hyper", "noise_var=-1"], "noise_var must be positive"),
        (["--method", "pfnm", "--hyper", "gamma0=0"], "gamma0 must be positive"),
        (["--method", "kl"], "HorseshoeBNN"),
        (["--method", "pfnm", "--format", "pt", "--hyper", "n_iter=two"], "must be int"),
        (
            ["--method", "pfmn"],
            "unknown method 'pfmn': method must be one of pfnm, nafi, fedma, fedavg, ot, kl (did you mean 'pfnm'?)",
        ),
        (
            ["--method", "pfnm", "--hyper", "noise_vr=1"],
            "unknown hyper-parameter 'noise_vr' for pfnm (did you mean 'noise_var'?)",
        ),
        (["--method", "ot", "--device", "cpu"], "--device 'cpu': method 'ot' runs on the host only"),
    ],
)
def test_cli_rejects_bad_options(files, tmp_path, capsys, argv, message):
    good, _ = files
    out = tmp_path / "fused.pt"
    assert main(["fuse", *map(str, good), *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--method", "pfnm", "--out", "{dir}"],
            "the output {dir} is a directory; give a file name for it, such as {dir}/fused.pt",
        ),
        (
            ["--method", "pfnm", "--out", "{dir}/fused.pt", "--one"],
            "one model file given ({good0}); fusion needs two or more (one model would come back as itself)",
        ),
    ],
)
def test_cli_refuses_before_any_model_is_read(files, tmp_path, capsys, monkeypatch, argv, message):
    import bayesfuse.checkpoints

    good, _ = files
    out_dir = tmp_path / "outputs.pt"
    out_dir.mkdir()
    one = "--one" in argv
    argv = [a.format(dir=out_dir) for a in argv if a != "--one"]
    monkeypatch.setattr(bayesfuse.checkpoints, "read_checkpoint", lambda *a: pytest.fail("a model file was read"))
    assert main(["fuse", *map(str, good[:1] if one else good), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "bayesfuse fuse: error: " + message.format(dir=out_dir, good0=good[0])
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seed", "-1"], "argument --seed: must be a non-negative integer, got -1"),
        (["--arch", "resnet"], "argument --arch: invalid choice: 'resnet' (choose from 'auto', 'mlp', 'cnn', 'lstm')"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_cli_usage_errors_are_one_line(files, tmp_path, capsys, argv, message):
    good, _ = files
    with pytest.raises(SystemExit) as info:
        main(["fuse", *map(str, good), "--method", "pfnm", "--out", str(tmp_path / "f.pt"), *argv])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"bayesfuse fuse: error: {message}; see bayesfuse fuse --help\n"


def test_cli_names_the_file_with_a_negative_batch_norm_variance(tmp_path, capsys):
    nets = [make_cnn(64, 3, channels=(2,), hidden=(4,)) for _ in range(2)]
    paths = [save_state_dict(n.state_dict(), tmp_path / f"c{j}.pt") for j, n in enumerate(nets)]
    broken = nets[1].state_dict()
    key = next(k for k in broken if k.endswith("running_var"))
    broken[key][1] = -0.5
    paths[1] = save_state_dict(broken, tmp_path / "broken.pt")
    assert main(["fuse", *map(str, paths), "--method", "pfnm", "--out", str(tmp_path / "f.pt")]) == 2
    assert capsys.readouterr().err == (
        f"bayesfuse fuse: error: {paths[1]}: batch norm {key.removesuffix('.running_var')!r} has a negative running "
        "variance (-0.5 at unit 1), which no trained batch norm has: the file is damaged or its entries are misnamed\n"
    )
    assert not (tmp_path / "f.pt").exists()


def test_cli_never_overwrites_without_force(files, tmp_path, capsys):
    good, _ = files
    out = tmp_path / "fused.pt"
    out.write_bytes(b"precious")
    assert main(["fuse", *map(str, good), "--method", "fedavg", "--out", str(out)]) == 2
    assert out.read_bytes() == b"precious" and "--force" in capsys.readouterr().err
    assert main(["fuse", *map(str, good), "--method", "fedavg", "--out", str(good[0])]) == 2


def _written(tmp_path, before):
    return sorted(set(p.name for p in tmp_path.iterdir()) - before)


@pytest.mark.parametrize(
    "out, argv, message",
    [
        (
            "fused.pt",
            ["--format", "safetensors"],
            "the output 'fused.pt' is named like a pt file but the format asked for "
            "is safetensors; give it a .safetensors name, or give --format pt or "
            "safetensors",
        ),
        ("fused.safetensors", ["--format", "pt"], "named like a safetensors file but the format asked for is pt"),
        (
            "fused.txt",
            [],
            "cannot tell the output format from 'fused.txt': name it .pt, .pth or .safetensors, or give "
            "--format pt or safetensors",
        ),
        ("", [], "the output '' is not a file name; give one such as fused.pt"),
    ],
)
def test_cli_output_name_and_format_must_agree(files, tmp_path, capsys, monkeypatch, out, argv, message):
    good, _ = files
    monkeypatch.chdir(tmp_path)  # an empty --out must not write into the working directory either
    before = {p.name for p in tmp_path.iterdir()}
    assert main(["fuse", *map(str, good), "--method", "pfnm", *argv, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert _written(tmp_path, before) == []


def test_cli_unknown_output_suffix_with_a_format_is_written(files, tmp_path):
    good, _ = files
    assert (
        main(
            [
                "fuse",
                *map(str, good),
                "--method",
                "pfnm",
                "--format",
                "safetensors",
                "--out",
                str(tmp_path / "fused.bin"),
            ]
        )
        == 0
    )
    assert safetensors_load((tmp_path / "fused.bin").read_bytes()).keys() == _mlp_sd().keys()


@pytest.fixture
def bnn_files(tmp_path):
    def save(name, scales=None, seed=0):
        torch.manual_seed(seed)
        state = HorseshoeBNN(5, 4, 3).state_dict()
        if scales is not None:
            state["prior_scales"] = torch.tensor(scales, dtype=torch.float64)
        return save_state_dict(state, tmp_path / name)

    return save("good.pt"), {
        "three scales": save("three.pt", [0.1, 1.0, 2.0], 1),
        "negative scale": save("negative.pt", [-0.1, 1.0], 1),
    }


@pytest.mark.parametrize(
    "case, message",
    [
        ("three scales", "three.pt: 'prior_scales' has shape (3,), expected (2,)"),
        (
            "negative scale",
            "negative.pt: not a consistent HorseshoeBNN state_dict ('prior_scales' must hold two "
            "positive finite numbers",
        ),
    ],
)
def test_cli_rejects_bad_bnn_files(bnn_files, tmp_path, capsys, case, message):
    good, bad = bnn_files
    out = tmp_path / "fused.pt"
    assert main(["fuse", str(good), str(bad[case]), "--method", "kl", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists() and not (tmp_path / "fused.pt.json").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"axes": {"fc1.weight": ["P1", null]}, "groups": 3}',
            "spec.json: a spec's 'groups' lists the hidden permutation groups in forward order: a list of names",
        ),
        (
            '{"axes": {"fc1.weight": ["P1", null]}, "groups": ["P2"]}',
            "spec.json: a spec's 'groups' must list each group",
        ),
        ('{"axes": {"fc1.weight": ["P1", null]}, "groups": ["P1", "P1"]}', "must list each group its axes use"),
        ('{"axes": {"fc1.weight": ["P1", null]}, "output": "fc2.weight"}', "spec.json: a spec's 'output'"),
        ('{"axes": {"fc1.weight": ["P1", null]}, "folds": ["bn"]}', "spec.json: a spec's 'folds'"),
        ('{"axes": {"fc1.weight": ["P1", null]}, "eps": {"bn": true}}', "spec.json: a spec's 'eps'"),
        ("[1, 2]", "spec.json: an architecture spec needs an 'axes' object"),
        (None, "spec.json is a directory"),
    ],
)
def test_cli_rejects_malformed_spec_files(files, tmp_path, capsys, content, message):
    good, _ = files
    spec = tmp_path / "spec.json"
    if content is None:
        spec.mkdir()
    else:
        spec.write_text(content)
    out = tmp_path / "fused.pt"
    assert main(["fuse", *map(str, good), "--method", "pfnm", "--arch-spec", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists() and not (tmp_path / "fused.pt.json").exists()


API_CASES = [
    (lambda: match_neurons([np.ones((2, 3)), np.ones((2, 4))]), ValueError, "dimension"),
    (lambda: match_neurons([np.ones((2, 3)), np.ones((0, 3))]), ValueError, "empty client"),
    (lambda: match_neurons([np.full((2, 3), np.nan)]), ValueError, "NaN"),
    (lambda: match_neurons([np.ones((2, 3))], gamma0=0.0), ValueError, "gamma0"),
    (lambda: match_neurons([np.ones((2, 3))], noise_var=0.0), ValueError, "noise_var"),
    (lambda: kl_fuse([DiagNormal(loc=np.zeros((2, 2)), var=np.ones((2, 2)))], reg=-1.0), ValueError, "reg"),
    (
        lambda: kl_fuse(
            [DiagNormal(loc=np.zeros((2, 2)), var=np.ones((2, 2))), Gamma(shape=np.ones((2, 2)), rate=np.ones((2, 2)))]
        ),
        TypeError,
        "cannot mix",
    ),
    (lambda: DiagNormal(loc=np.zeros((2, 2)), var=-np.ones((2, 2))), ValueError, "positive"),
    (
        lambda: fuse([MLP(4, [3], 2), MLP(4, [3], 5)]),
        ValueError,
        "client [01] has [25] classes .* client [01] has [25]",
    ),
    (lambda: fuse([MLP(4, [3], 2)], "hungarian"), ValueError, "method must be one of"),
    (lambda: fuse([]), ValueError, "at least one"),
    (lambda: dirichlet_partition(np.arange(10) % 2, 3, 0.0), ValueError, "alpha"),
    (lambda: load_state_dict("/nonexistent/model.pt"), FileNotFoundError, "not found"),
    # deep networks
    (
        lambda: fuse([nn.Sequential(nn.Linear(4, 6), nn.MultiheadAttention(6, 2)) for _ in range(2)]),
        ValueError,
        r"example input of shape \(2, 4\) does not run through the network \(TypeError: .*missing 2 required",
    ),
    (
        lambda: fuse(
            [nn.Sequential(nn.Conv2d(1, 8, 3), nn.PixelShuffle(2), nn.Flatten()) for _ in range(2)],
            example_input=torch.zeros(2, 1, 4, 4),
        ),
        UnsupportedLayerError,
        r"call_module 1 \(_1\): PixelShuffle is not supported",
    ),
    (
        lambda: fuse([make_cnn(64, 3, channels=(2,), hidden=(4,)), MLP(64, [4], 3)]),
        ValueError,
        "client [01] lacks entries",
    ),
    (lambda: fuse([MLP(4, [3, 3], 2) for _ in range(2)], "fedma"), ValueError, r"data=\(train, partition\)"),
    (
        lambda: fuse([MLP(4, [3, 3], 2) for _ in range(2)], "fedma", rounds=3),
        ValueError,
        r"method='fedma' runs its own rounds .*rounds=2 adds one more, the refit round",
    ),
    (
        lambda: fuse([MLP(4, [3, 3], 2) for _ in range(2)], "fedma", rounds=2, second_round="temperature"),
        ValueError,
        "method='fedma' runs its own rounds",
    ),
    (
        lambda: fuse(
            [MLP(4, [3], 2) for _ in range(2)],
            "pfnm",
            rounds=2,
            data=(Dataset(np.zeros((5, 4), np.float32), np.arange(5) % 2, 2, "tiny"), [np.arange(3), np.arange(3, 9)]),
        ),
        ValueError,
        r"client 1's examples are not indices into the 5 examples of data\[0\] \(range 3..8\)",
    ),
    # what a call asks for is done or refused, never ignored
    (
        lambda: fuse([MLP(4, [3], 2) for _ in range(2)], "pfnm", second_round="temperature"),
        ValueError,
        r"second_round='temperature' is what a second round does: give rounds=2",
    ),
    (
        lambda: fuse([MLP(4, [3], 2) for _ in range(2)], "pfnm", retrain=TrainConfig(epochs=1)),
        ValueError,
        r"retrain= is the local training of method='fedma' between layers; method='pfnm' trains nothing",
    ),
    (
        lambda: fuse([MLP(4, [3], 2) for _ in range(2)], "pfnm", pseudo_count=1.0),
        ValueError,
        r"pseudo_count smooths the clients' own heads; this fusion kept one shared output layer",
    ),
    (
        lambda: fuse([MLP(4, [3], 2) for _ in range(2)], "pfnm", pseudo_count=-1.0),
        ValueError,
        r"pseudo_count must be a finite number >= 0",
    ),
    (lambda: fuse([MLP(4, [3, 3], 2) for _ in range(2)], "pfnm", direction="sideways"), ValueError, "direction"),
    (
        lambda: fedma([MLP(4, [3], 2).state_dict()] * 2, MLP(4, [3], 2).permutation_spec(), lambda jobs, frozen: []),
        ValueError,
        "returned 0 states for 2 clients",
    ),
    (lambda: PANConfig("add", 1.0, -0.1), ValueError, "amplitude"),
    (lambda: TrainConfig(arch="transformer"), ValueError, "unknown architecture 'transformer'"),
    # errors that say what to do
    (
        lambda: fuse([MLP(4, [3], 2).state_dict()] * 2),
        TypeError,
        r"model 0 is a state_dict \(OrderedDict\), not an nn.Module: fuse state_dicts with bayesfuse.fuse_states",
    ),
    (
        lambda: fuse([MLP(4, [3], 2) for _ in range(2)], class_count=np.ones((2, 2))),
        ValueError,
        r"\['class_count'\] for method 'pfnm', and not arguments of fuse \(did you mean 'class_counts'\?\)",
    ),
    (
        lambda: fuse([MLP(4, [3], 2) for _ in range(2)], "nafi", noise_vr=1.0),
        ValueError,
        r"\(did you mean 'noise_var'\?\)",
    ),
    (
        lambda: fuse([MLP(4, [3], 2) for _ in range(2)], "pfmn"),
        ValueError,
        r"unknown method 'pfmn'.*\(did you mean 'pfnm'\?\)",
    ),
    (
        lambda: fuse_states([MLP(4, [3], 2).state_dict()] * 2, seeed=1),
        ValueError,
        r"not arguments of fuse_states \(did you mean 'seed'\?\)",
    ),
    (
        lambda: kl_fuse(
            [
                DiagNormal(loc=np.zeros((3, 4)), var=np.ones((3, 4))),
                DiagNormal(loc=np.zeros((3, 4)), var=np.where(np.eye(3, 4) > 0, 1e300, 1.0)),
            ]
        ),
        ValueError,
        r"client 1's variance 1e\+300 \(component 0, coordinate 0\) is 1\.0e\+300 times larger than the clients' median "
        r"variance 1: kl_fuse needs all variances within a factor 1e\+15",
    ),
    (
        lambda: kl_fuse(
            [
                DiagNormal(loc=np.zeros((2, 2)), var=np.full((2, 2), 1e-20)),
                DiagNormal(loc=np.zeros((2, 2)), var=np.ones((2, 2))),
                DiagNormal(loc=np.zeros((2, 2)), var=np.ones((2, 2))),
            ]
        ),
        ValueError,
        r"client 0's variance 1e-20 \(component 0, coordinate 0\) is 1\.0e\+20 times smaller",
    ),
    # not models: a path, a lone model, arrays where families are needed, a list where names are needed
    (
        lambda: fuse(["a.pt", "b.pt"]),
        TypeError,
        r"model 0 is a path \('a.pt'\), not an nn.Module: load each with bayesfuse.load",
    ),
    (lambda: fuse(MLP(4, [3], 2)), TypeError, "fuse takes a list of models, got a MLP"),
    (
        lambda: fuse([MLP(4, [3], 2), 3]),
        TypeError,
        r"model 1 is not an nn.Module \(a network or a HorseshoeBNN\): got int",
    ),
    (
        lambda: kl_fuse([np.zeros((3, 4)), np.zeros((3, 4))], reg=0.1),
        TypeError,
        "item 0 is a ndarray, not a batch of exponential-family components",
    ),
    (lambda: _ood_report([MLP(4, [3], 2)]), TypeError, "report takes a mapping of names to models"),
    (lambda: _plot_report({"a": 1}), ValueError, r"plot_report draws what report\(\) returns.*got a dict"),
    # predictions: never NaN returned, never a torch error
    (
        lambda: _bnn().predict(_x(nan=True), num_samples=5),
        ValueError,
        r"x has NaN or infinite values \(example 1 of 3\)",
    ),
    (lambda: _bnn().predict(_x(), num_samples=0), ValueError, "num_samples must be a positive integer, got 0"),
    (lambda: _bnn().predict(_x(), num_samples=-1), ValueError, "num_samples must be a positive integer, got -1"),
    (lambda: _bnn().predict(_x()[:0], num_samples=5), ValueError, "cannot predict on 0 examples"),
    (lambda: _predict_proba(MLP(4, [3], 2), _x(nan=True)), ValueError, r"x has NaN or infinite values \(example 1"),
    (lambda: _predict_proba(_bnn(), _x()), TypeError, r"a HorseshoeBNN predicts by its Monte Carlo predictive"),
    (lambda: _predict_proba("net", _x()), TypeError, "predict_proba needs a network"),
    (lambda: _compare({"bnn": _bnn()}, _x(), np.zeros(2, dtype=int)), ValueError, "2 labels .* for 3 examples"),
    (lambda: HorseshoeBNN(4, [3], 2, init_scale=-0.1), ValueError, "init_scale .* must be positive, got -0.1"),
    (
        lambda: fuse([MLP(4, [3], 2) for _ in range(2)], class_counts=np.full((2, 2), 0.25)),
        ValueError,
        "class_counts must be whole numbers of examples per client and class, not shares",
    ),
    (lambda: _train_bnn(n_classes=0), ValueError, "n_classes must be a positive integer, got 0"),
]


def _x(nan: bool = False) -> np.ndarray:
    x = np.arange(12, dtype=np.float64).reshape(3, 4) / 10
    if nan:
        x[1, 2] = np.nan
    return x


def _bnn() -> HorseshoeBNN:
    torch.manual_seed(0)
    return HorseshoeBNN(4, [3], 2)


def _ood_report(models):
    from bayesfuse.ood import report

    return report(models, _x(), _x())


def _plot_report(table):
    from bayesfuse.ood import plot_report

    return plot_report(table)


def _predict_proba(model, x):
    from bayesfuse.nets import predict_proba

    return predict_proba(model, x)


def _compare(models, x, y):
    from bayesfuse.analysis import compare

    return compare(models, x, y)


def _train_bnn(n_classes: int):
    from bayesfuse.models.bnn import train_bnn

    return train_bnn(_x(), np.zeros(3, dtype=int), n_classes, hidden=3)


@pytest.mark.parametrize("call, exc, message", API_CASES)
def test_api_rejects_bad_inputs(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_single_model_returns_itself_with_one_line_at_the_callers_line():
    """One model is passed through (a federated round can end with one valid reply), said in one
    line that points at the line calling fuse, not at the package's own."""
    model = MLP(4, [3], 2)
    with pytest.warns(UserWarning, match=r"^only one model: fusion returns it .*; give two or more models") as caught:
        res = fuse([model], prior_var=1e8)
    assert [w.filename for w in caught] == [__file__]
    x = torch.randn(5, 4)
    torch.testing.assert_close(res.model(x), model(x), rtol=1e-4, atol=1e-5)
    with pytest.warns(UserWarning, match="only one model") as caught:
        fuse_states([numpy_state(model)], "pfnm")
    assert [w.filename for w in caught] == [__file__]


def test_predicting_with_an_ensemble_leaves_its_members_modes_as_they_were():
    from bayesfuse import Ensemble
    from bayesfuse.nets import predict_proba

    members = [MLP(4, [3], 2).eval(), MLP(4, [3], 2).train()]
    predict_proba(Ensemble(members), _x())
    assert [m.training for m in members] == [False, True]
