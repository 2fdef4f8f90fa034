"""Files of a user's own networks: the architecture traced from the network (``like=``,
``bayesfuse fuse --model``), never a chain guessed where the names leave a skip possible."""

import contextlib
import json

import pytest
import torch

import bayesfuse
from bayesfuse.checkpoints import save_state_dict
from bayesfuse.cli import main
from tests.nets.test_graph_spec import _random
from tests.nets.user_nets import (
    ArgmaxUnits,
    ConcatMLP,
    HandLinear,
    MyMLP,
    PatchTokens,
    PatchTokensUnguessed,
    ResMLP,
    SkipCNN,
    TiedGPT,
    TwoOutputs,
    UnequalSplit,
    UpConv1d,
    UpConvUNet,
    VolumeCNN,
)


def _files(tmp_path, cls, n=3):
    models = [_random(cls, seed) for seed in range(n)]
    return models, [
        str(save_state_dict(m.state_dict(), tmp_path / f"{cls.__name__}{j}.pt")) for j, m in enumerate(models)
    ]


@pytest.mark.parametrize("cls", [ResMLP, SkipCNN])
def test_residual_files_without_the_network_are_refused_and_nothing_is_written(tmp_path, capsys, cls):
    _, paths = _files(tmp_path, cls)
    out = tmp_path / "fused.pt"
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--model MODULE:NAME" in err, err
    assert (
        ("skip connection possible" in err and "--arch cnn" in err)
        if cls is SkipCNN
        else "are not a plain chain's" in err
    ), err
    assert list(tmp_path.glob("fused*")) == []


@pytest.mark.parametrize("cls", [ResMLP, SkipCNN])
def test_residual_files_fuse_with_the_network_given_and_load_into_it(tmp_path, capsys, cls):
    models, paths = _files(tmp_path, cls)
    out = tmp_path / "fused.pt"
    assert (
        main(["fuse", *paths, "--method", "pfnm", "--model", f"tests.nets.user_nets:{cls.__name__}", "--out", str(out)])
        == 0
    )
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert report["architecture"]["source"] == f"traced from tests.nets.user_nets.{cls.__name__}"
    loaded = bayesfuse.load(out, like=cls())
    python = bayesfuse.fuse(models, "pfnm").model  # the same fusion in Python, from the modules
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert float((loaded(x) - python(x)).abs().max()) < 1e-4


def test_a_plain_chain_read_off_names_is_said_so(tmp_path, capsys):
    _, paths = _files(tmp_path, MyMLP)
    out = tmp_path / "fused.pt"
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "architecture read from the files' entry names, as a plain chain" in captured.out
    assert (
        json.loads((tmp_path / "fused.pt.json").read_text())["architecture"]["source"]
        == "entry names, as a plain chain"
    )
    assert bayesfuse.load(out, like=MyMLP())(torch.zeros(2, 64)).shape == (2, 10)


def test_arch_mlp_confirms_a_plain_chain(tmp_path):
    """Two hidden layers of one width could be a residual pair; --arch mlp says they are not."""
    torch.manual_seed(0)
    nets = [
        torch.nn.Sequential(
            torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)
        )
        for _ in range(2)
    ]

    class Named(torch.nn.Module):  # the same layers under names that do not show a Sequential
        def __init__(self, seq):
            super().__init__()
            self.a, self.b, self.c = seq[0], seq[2], seq[4]

    paths = [str(save_state_dict(Named(n).state_dict(), tmp_path / f"n{j}.pt")) for j, n in enumerate(nets)]
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(tmp_path / "a.pt")]) == 2
    assert main(["fuse", *paths, "--method", "pfnm", "--arch", "mlp", "--out", str(tmp_path / "a.pt")]) == 0
    seq = [str(save_state_dict(n.state_dict(), tmp_path / f"s{j}.pt")) for j, n in enumerate(nets)]
    assert main(["fuse", *seq, "--method", "pfnm", "--out", str(tmp_path / "b.pt")]) == 0  # a Sequential: no skips


@pytest.mark.parametrize(
    "ref, message",
    [
        ("nomodule", "expected MODULE:NAME or FILE.py:NAME"),
        ("no_such_package_xyz:Net", r"cannot import no_such_package_xyz \(ModuleNotFoundError"),
        ("tests.nets.user_nets:Missing", "has no class or function 'Missing'"),
        ("tests.nets.user_nets:NeedsArgs", r"NeedsArgs\(\) failed \(TypeError"),
        ("missing_file.py:Net", "cannot import missing_file.py"),
    ],
)
def test_bad_model_references_get_one_line(tmp_path, capsys, ref, message):
    _, paths = _files(tmp_path, MyMLP, 2)
    assert main(["fuse", *paths, "--method", "pfnm", "--model", ref, "--out", str(tmp_path / "f.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and __import__("re").search(message, err), err
    assert not (tmp_path / "f.pt").exists()


def test_model_references_take_literal_arguments(tmp_path, capsys):
    """``--model MODULE:NAME(ARGS)`` builds the network with literal arguments
    (``torchvision.models:resnet18(num_classes=10)``), read by ``ast.literal_eval``: no expression
    in them is evaluated, and one call of the name, nothing after it, is made."""

    models = [_random(lambda: ResMLP(blocks=3), seed) for seed in range(2)]
    paths = [str(save_state_dict(m.state_dict(), tmp_path / f"deep{j}.pt")) for j, m in enumerate(models)]
    out = tmp_path / "f.pt"
    ref = "tests.nets.user_nets:ResMLP(64, blocks=3)"
    assert main(["fuse", *paths, "--method", "pfnm", "--model", ref, "--out", str(out)]) == 0
    fused = bayesfuse.load(out, like=ResMLP(blocks=3))
    assert fused(torch.randn(4, 64)).shape == (4, 10)
    capsys.readouterr()
    for bad, message in (
        ("tests.nets.user_nets:ResMLP(blocks=len('abc'))", "its arguments must be Python literals"),
        ("tests.nets.user_nets:ResMLP(**{'blocks': 3})", "its arguments must be Python literals"),
        ("tests.nets.user_nets:ResMLP(blocks=3", "expected MODULE:NAME or FILE.py:NAME, with literal arguments"),
        ("tests.nets.user_nets:ResMLP(64)(blocks=3)", r"one call of the name"),
        ("tests.nets.user_nets:ResMLP(blocks=3, blocks=2)", r"an argument given twice"),
        ("tests.nets.user_nets:ResMLP(depth=3)", r"ResMLP\(depth=3\) failed \(TypeError"),
    ):
        assert main(["fuse", *paths, "--method", "pfnm", "--model", bad, "--out", str(tmp_path / "g.pt")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and __import__("re").search(message, err), err
    assert not (tmp_path / "g.pt").exists()
    from bayesfuse.nets.user_module import model_from_reference

    with pytest.raises(ValueError) as err:  # arguments over two lines: the message still one
        model_from_reference("tests.nets.user_nets:ResMLP(depth=\n 3)")
    assert "\n" not in str(err.value) and "ResMLP(depth= 3) failed" in str(err.value)


def test_model_from_a_file_path(tmp_path):
    source = tmp_path / "my nets (1).py"  # a path may hold parentheses (a browser's second download)
    source.write_text("from tests.nets.user_nets import ResMLP\n\ndef build():\n    return ResMLP()\n")
    _, paths = _files(tmp_path, ResMLP, 2)
    assert (
        main(
            ["fuse", *paths, "--method", "nafi", "--model", f"{source}:build", "--out", str(tmp_path / "f.safetensors")]
        )
        == 0
    )


def test_a_width_the_network_holds_follows_the_fused_file(tmp_path):
    """``--model`` of a network whose forward reshapes by ``self.hidden_dim``: the fused file
    loads into it at the fused width, the attribute set to it, in the CLI's check and in
    ``bayesfuse.load``."""
    models, paths = _files(tmp_path, PatchTokens, 3)
    out = tmp_path / "fused.pt"
    ref = "tests.nets.user_nets:PatchTokens"
    assert main(["fuse", *paths, "--method", "pfnm", "--model", ref, "--out", str(out)]) == 0
    fused = bayesfuse.load(out, like=PatchTokens())
    assert fused.hidden_dim == fused.patch.out_channels > 12
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert report["architecture"]["widths"] == {"hidden_dim": fused.hidden_dim}  # what the report says it set
    assert fused(torch.randn(4, 64)).shape == (4, 10)


def test_a_spec_file_without_widths_takes_the_widths_the_network_holds(tmp_path):
    """``--arch-spec`` beside ``--model``: a spec file that lists no ``widths`` gets the numbers
    the network holds as widths from its trace, on the file's own group names (the file names its
    group "stream", the trace "P1"); the fused file loads and runs."""
    from bayesfuse.inference.spec_io import spec_to_dict
    from bayesfuse.nets.graph_spec import spec_from_graph

    models, paths = _files(tmp_path, PatchTokens, 3)
    data = json.loads(json.dumps(spec_to_dict(spec_from_graph(models[0]))).replace('"P1"', '"stream"'))
    assert data.pop("widths") == {"hidden_dim": "stream"}
    (tmp_path / "s.json").write_text(json.dumps(data))
    out = tmp_path / "fused.pt"
    ref = ["--model", "tests.nets.user_nets:PatchTokens", "--arch-spec", str(tmp_path / "s.json")]
    assert main(["fuse", *paths, "--method", "pfnm", *ref, "--out", str(out)]) == 0
    report = json.loads((tmp_path / "fused.pt.json").read_text())["architecture"]
    assert report["source"] == "spec file, the widths the network holds (hidden_dim) traced from it"
    fused = bayesfuse.load(out, like=PatchTokens())
    assert fused.hidden_dim == fused.patch.out_channels == report["widths"]["hidden_dim"] > 12
    assert fused(torch.randn(4, 64)).shape == (4, 10)


def test_weights_tied_are_one_tensor_in_the_fused_file(tmp_path):
    """``--model`` of a language model whose embedding is its output layer's weight: the fused
    file holds the one fused tensor under both names (each fused as an entry, then tied), the
    report says so, and ``bayesfuse.load`` gives back a network that holds it once."""
    _, paths = _files(tmp_path, TiedGPT, 3)
    out = tmp_path / "fused.pt"
    assert main(["fuse", *paths, "--method", "pfnm", "--model", "tests.nets.user_nets:TiedGPT", "--out", str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert state["wte.weight"].shape[1] > 16 and torch.equal(state["wte.weight"], state["lm_head.weight"])
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert report["hyper"]["tied"] == {"wte.weight": "lm_head.weight"}
    fused = bayesfuse.load(out, like=TiedGPT())
    assert fused.wte.weight is fused.lm_head.weight
    assert fused(torch.randint(0, 12, (4, 6))).shape == (4, 6, 12)


def test_load_runs_the_network_on_the_input_the_file_records(tmp_path):
    """``--input-shape`` is recorded in the report, and ``bayesfuse.load`` traces and runs the
    network it is given on it (the width it holds set to the fused one); a file that records no
    input loads with a warning that the network was not run."""
    _, paths = _files(tmp_path, PatchTokensUnguessed, 3)
    out = tmp_path / "fused.pt"
    ref = ["--model", "tests.nets.user_nets:PatchTokensUnguessed", "--input-shape", "64"]
    assert main(["fuse", *paths, "--method", "pfnm", *ref, "--out", str(out)]) == 0
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert report["architecture"]["input_shape"] == [64] and report["architecture"]["input_dtype"] == "float32"
    fused = bayesfuse.load(out, like=PatchTokensUnguessed())
    assert fused.hidden_dim == fused.patch.out_channels > 12 and fused(torch.randn(3, 64)).shape == (3, 10)
    del report["architecture"]["input_shape"]
    (tmp_path / "fused.pt.json").write_text(json.dumps(report))
    with pytest.warns(UserWarning, match="without running it"):
        bayesfuse.load(out, like=PatchTokensUnguessed())
    report["architecture"]["input_shape"] = [64, -1]
    (tmp_path / "fused.pt.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match="its input shape is not what bayesfuse fuse writes"):
        bayesfuse.load(out, like=PatchTokensUnguessed())
    report["architecture"].update(input_shape=[64], input_dtype="qint8")
    (tmp_path / "fused.pt.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match="its input shape is not what bayesfuse fuse writes"):
        bayesfuse.load(out, like=PatchTokensUnguessed())


def test_an_input_record_is_read_only_where_a_network_is_run_on_it(tmp_path):
    """A file load recognises from its entries (an MLP) loads whatever its report's input record
    says: the record is read only for a network given or named."""
    from bayesfuse import MLP

    torch.manual_seed(0)
    paths = [str(save_state_dict(MLP(64, (16,), 10).state_dict(), tmp_path / f"m{j}.pt")) for j in range(2)]
    out = tmp_path / "fused.pt"
    assert main(["fuse", *paths, "--method", "pfnm", "--arch", "mlp", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    report["architecture"]["input_shape"] = ["4"]
    (tmp_path / "fused.pt.json").write_text(json.dumps(report))
    assert bayesfuse.load(out)(torch.randn(2, 64)).shape == (2, 10)


def test_load_checks_the_file_against_the_network(tmp_path):
    _, paths = _files(tmp_path, ResMLP, 2)
    out = tmp_path / "fused.pt"
    assert main(["fuse", *paths, "--method", "pfnm", "--model", "tests.nets.user_nets:ResMLP", "--out", str(out)]) == 0
    with pytest.raises(ValueError, match="do not fit the template network"):
        bayesfuse.load(out, like=SkipCNN())


def test_resnet_state_dicts_without_the_network_are_told_to_give_it(tmp_path, capsys):
    from bayesfuse.nets.resnet import resnet20

    torch.manual_seed(0)
    paths = [str(save_state_dict(resnet20(width=0.25).state_dict(), tmp_path / f"r{j}.pt")) for j in range(2)]
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(tmp_path / "f.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "do not chain as a plain network" in err and "--model MODULE:NAME" in err, err
    assert not (tmp_path / "f.pt").exists()


def test_a_network_that_does_not_tell_its_input_shape_takes_input_shape(tmp_path, capsys):
    """StepGRU's first Linear reads steps of 8 features: an input made from its width (2, 8) does
    not run. The command line asks for --input-shape; given it, the files fuse as in Python, and
    ``load`` runs the network on the shape the file records, or, where it records none, asks for
    ``example_input`` in turn."""
    from tests.nets.user_nets import StepGRU

    models, paths = _files(tmp_path, StepGRU)
    out = tmp_path / "fused.pt"
    ref = ["--model", "tests.nets.user_nets:StepGRU"]
    assert main(["fuse", *paths, "--method", "pfnm", *ref, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--input-shape D,...: the shape of one input" in err, err
    assert list(tmp_path.glob("fused*")) == []
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(out), "--input-shape", "64"]) == 2
    assert "--input-shape is the shape of --model's input: give --model too" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # argparse's usage error
        main(["fuse", *paths, "--method", "pfnm", *ref, "--out", str(out), "--input-shape", "8,x"])
    assert stop.value.code == 2
    assert "expected positive integers separated by commas" in capsys.readouterr().err
    assert main(["fuse", *paths, "--method", "pfnm", *ref, "--out", str(out), "--input-shape", "64"]) == 0
    x = torch.randn(16, 64)
    python = bayesfuse.fuse(models, "pfnm", example_input=x[:2]).model
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert report["architecture"]["input_shape"] == [64]
    for loaded in (bayesfuse.load(out, like=StepGRU()), bayesfuse.load(out, like=StepGRU(), example_input=x[:2])):
        with torch.no_grad():
            assert float((loaded(x) - python(x)).abs().max()) < 1e-4
    del report["architecture"]["input_shape"]  # a file that records no input
    (tmp_path / "fused.pt.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match=r"give an example input \(example_input=\.\.\.: a batch of your data\)"):
        bayesfuse.load(out, like=StepGRU())


def test_input_shape_gives_token_ids_to_a_network_that_reads_them(tmp_path, capsys):
    """An nn.EmbeddingBag first reads integer ids: --input-shape makes integer zeros for it."""
    from tests.nets.user_nets import IdsBag

    models, paths = _files(tmp_path, IdsBag)
    out, ref = tmp_path / "fused.pt", ["--model", "tests.nets.user_nets:IdsBag"]
    assert main(["fuse", *paths, "--method", "pfnm", *ref, "--out", str(out), "--input-shape", "12"]) == 0, (
        capsys.readouterr().err
    )
    ids = torch.randint(0, 40, (16, 12))
    loaded = bayesfuse.load(out, like=IdsBag(), example_input=ids[:2])
    python = bayesfuse.fuse(models, "pfnm", example_input=ids[:2]).model
    with torch.no_grad():
        assert float((loaded(ids) - python(ids)).abs().max()) < 1e-5


def test_summarize_takes_the_network_for_files_whose_names_it_cannot_read(tmp_path, capsys):
    import numpy as np

    from tests.nets.user_nets import StepGRU

    _, paths = _files(tmp_path, StepGRU, n=2)
    gen = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    np.savez(data, x=gen.normal(size=(30, 64)).astype(np.float32), y=np.arange(30) % 10)
    assert main(["summarize", paths[0], "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert "give your network with --model MODULE:NAME" in err, err
    for path in paths:
        assert main(["summarize", path, "--data", str(data), "--model", "tests.nets.user_nets:StepGRU"]) == 0
    out = tmp_path / "fused.pt"
    ref = ["--model", "tests.nets.user_nets:StepGRU", "--input-shape", "64"]
    assert main(["fuse", *paths, "--method", "pfnm", *ref, "--out", str(out)]) == 0
    assert json.loads((tmp_path / "fused.pt.json").read_text())["summaries"]["used"] is True


@pytest.mark.parametrize("cls, model", [(ArgmaxUnits, True), (ConcatMLP, False), (ResMLP, False)])
def test_fedavg_averages_files_whose_units_cannot_be_read_as_python_does(tmp_path, capsys, cls, model):
    """FedAvg needs no units: files of a network that cannot be traced (or, without the network,
    whose names do not show a chain) are averaged entry by entry, as ``bayesfuse.fuse`` averages
    the modules; matching them is still refused."""
    models, paths = _files(tmp_path, cls)
    ref = ["--model", f"tests.nets.user_nets:{cls.__name__}"] if model else []
    out = tmp_path / "avg.pt"
    assert main(["fuse", *paths, "--method", "fedavg", *ref, "--out", str(out)]) == 0
    assert "no units traced: every entry averaged as it is" in capsys.readouterr().out
    report = json.loads((tmp_path / "avg.pt.json").read_text())
    assert report["architecture"]["groups"] == [] and report["global_sizes"] == []
    loaded = bayesfuse.load(out, like=cls()) if model else cls()
    if not model:
        loaded.load_state_dict(torch.load(out, weights_only=True))
    with pytest.warns(UserWarning, match="no units traced") if cls is ArgmaxUnits else contextlib.nullcontext():
        python = bayesfuse.fuse(models, "fedavg").model
    for k, v in bayesfuse.fedavg(models).state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
        torch.testing.assert_close(python.state_dict()[k], v)
    assert main(["fuse", *paths, "--method", "pfnm", *ref, "--out", str(tmp_path / "m.pt")]) == 2
    assert not list(tmp_path.glob("m.pt*"))


def test_files_of_streams_side_by_side_fuse_with_the_module_given(tmp_path, capsys):
    """Branches of different widths concatenated: with the module each keeps its permutation and
    the fused file loads into the class at the fused widths; without the module, matching is
    refused and nothing written."""
    models, paths = _files(tmp_path, ConcatMLP)
    out = tmp_path / "fused.pt"
    assert (
        main(["fuse", *paths, "--method", "pfnm", "--model", "tests.nets.user_nets:ConcatMLP", "--out", str(out)]) == 0
    )
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert report["architecture"]["groups"] == ["P1", "P2"] and len(report["global_sizes"]) == 2
    loaded = bayesfuse.load(out, like=ConcatMLP())
    assert loaded.head.in_features == sum(report["global_sizes"]) and loaded(torch.randn(4, 64)).shape == (4, 10)
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(tmp_path / "m.pt")]) == 2
    assert not list(tmp_path.glob("m.pt*"))


@pytest.mark.parametrize("cls", [UpConvUNet, UpConv1d, VolumeCNN])
def test_files_of_transposed_convolutions_fuse_with_the_module_given(tmp_path, capsys, cls):
    """A transposed convolution's weight holds its units on axis 1, which entry names cannot
    show: without the module the files are refused in one line that asks for it, and nothing is
    written; with it, the fused file loads into the class at the fused widths and computes what
    the same fusion in Python computes."""
    models, paths = _files(tmp_path, cls)
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--model MODULE:NAME" in err, err
    assert not list(tmp_path.glob("m.pt*"))
    out = tmp_path / "fused.pt"
    ref = f"tests.nets.user_nets:{cls.__name__}"
    assert main(["fuse", *paths, "--method", "pfnm", "--model", ref, "--out", str(out)]) == 0
    loaded = bayesfuse.load(out, like=cls())
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    up = loaded.up2 if cls is UpConv1d else loaded.up
    assert up.out_channels in report["global_sizes"] and up.weight.shape[1] == up.out_channels
    python = bayesfuse.fuse(models, "pfnm").model
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert float((loaded(x) - python(x)).abs().max()) < 1e-4


def test_fedavg_of_a_weight_applied_by_hand_averages_and_says_why_in_the_command_lines_words(tmp_path, capsys):
    """A weight applied by ``torch.tensordot`` is a layer the walk cannot see: matching is
    refused, FedAvg averages. Without ``--input-shape`` the input made from the head's width does
    not run, which the note says in the command line's words; with it, the note names the weight."""
    models, paths = _files(tmp_path, HandLinear, n=2)
    ref = ["--model", "tests.nets.user_nets:HandLinear"]
    for shape, why in (([], "give an example input (--input-shape D,...: the shape of one input)"),
                       (["--input-shape", "5"], "tensordot applies the network's own weight 'w'")):  # fmt: skip
        out = tmp_path / f"avg{len(shape)}.pt"
        assert main(["fuse", *paths, "--method", "fedavg", *ref, *shape, "--out", str(out)]) == 0
        note = capsys.readouterr().out
        assert "no units traced: every entry averaged as it is" in note and why in note and "example_input=" not in note
        for k, v in bayesfuse.fedavg(models).state_dict().items():
            torch.testing.assert_close(
                bayesfuse.load(out, like=HandLinear(), example_input=torch.zeros(2, 5)).state_dict()[k], v
            )
        assert main(["fuse", *paths, "--method", "pfnm", *ref, *shape, "--out", str(tmp_path / "m.pt")]) == 2
        assert "applies the network's own weight 'w'" in capsys.readouterr().err or not shape
        assert not list(tmp_path.glob("m.pt*"))


def test_files_of_a_network_with_two_outputs_fuse_to_its_classes_and_tied_weights_stay_tied(tmp_path):
    """From files with ``--model``: a forward returning (logits, aux) fuses with its classes kept
    (the fused file loads and returns 10 logits); a network whose output layer is tied to its
    embedding fuses by OT and FedAvg, the tie kept."""
    from tests.nets.test_graph_spec import _Tied

    _, paths = _files(tmp_path, TwoOutputs)
    out = tmp_path / "two.pt"
    assert (
        main(["fuse", *paths, "--method", "pfnm", "--model", "tests.nets.user_nets:TwoOutputs", "--out", str(out)]) == 0
    )
    logits, aux = bayesfuse.load(out, like=TwoOutputs())(torch.randn(4, 64))
    assert logits.shape == (4, 10) and aux.shape == (4, 3)
    tied = [str(save_state_dict(_random(_Tied, s).state_dict(), tmp_path / f"tied{s}.pt")) for s in range(2)]
    ref = ["--model", "tests.nets.test_graph_spec:_Tied"]
    assert main(["fuse", *tied, "--method", "ot", *ref, "--out", str(tmp_path / "ot.pt")]) == 0
    state = torch.load(tmp_path / "ot.pt", weights_only=True)
    assert torch.equal(state["emb.weight"], state["out.weight"])
    assert main(["fuse", *tied, "--method", "fedavg", *ref, "--out", str(tmp_path / "t.pt")]) == 0
    model = _Tied()
    model.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=True))
    assert model.out.weight is model.emb.weight
    expected = bayesfuse.fedavg([_random(_Tied, s) for s in range(2)]).state_dict()
    torch.testing.assert_close(model.emb.weight, expected["emb.weight"])


def test_the_command_line_says_which_groups_it_held_at_the_widths_the_forward_fixes(tmp_path, capsys):
    """A gate cut by a width written in the code (``UnequalSplit(written=True)``): PFNM matches that
    piece at its width, and the command's line and its report say so."""
    models = [_random(lambda: UnequalSplit(written=True), seed) for seed in range(3)]
    paths = [str(save_state_dict(m.state_dict(), tmp_path / f"u{j}.pt")) for j, m in enumerate(models)]
    out = tmp_path / "f.pt"
    ref = "tests.nets.user_nets:UnequalSplit(written=True)"
    assert main(["fuse", *paths, "--method", "pfnm", "--model", ref, "--out", str(out)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    held = json.loads((tmp_path / "f.pt.json").read_text())["hyper"]["fixed"]
    assert held and f"({', '.join(held)} held at the widths the forward fixes)" in line
    fused = bayesfuse.load(out, like=UnequalSplit(written=True))
    assert fused.mix.in_features == 4 and fused(torch.randn(4, 64)).shape == (4, 10)


def test_the_command_line_says_which_units_it_kept_in_place(tmp_path, capsys):
    """A rotary language model's queries and keys meet ``cos`` and ``sin`` along their units: the
    command fuses the rest and names, on a line and in its report, the layers it kept in place."""
    from tests.nets.user_nets import RotaryLM

    paths = [str(save_state_dict(_random(RotaryLM, s).state_dict(), tmp_path / f"r{s}.pt")) for s in range(2)]
    out = tmp_path / "f.pt"
    assert (
        main(["fuse", *paths, "--method", "pfnm", "--model", "tests.nets.user_nets:RotaryLM", "--out", str(out)]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    kept = json.loads((tmp_path / "f.pt.json").read_text())["hyper"]["in_place"]
    assert set(kept) == {f"layers.{i}.attn.{p}_proj" for i in (0, 1) for p in "qk"}
    assert f"kept in place (numbers along their units that no permutation moves): {'; '.join(kept)}" in lines
    assert bayesfuse.load(out, like=RotaryLM())(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 12)
