"""The fusion methods: what each takes, its hyper-parameters and their defaults, in one table.

Every entry point (:func:`bayesfuse.fuse`, :func:`bayesfuse.core.fuse_states`,
``bayesfuse fuse``, the Flower strategy and FedMA server loop,
:func:`bayesfuse.federated.run_fedma`, the demo) resolves its hyper-parameters with
:func:`resolve`, so a method's defaults and constraints live here and nowhere else; the
algorithms' own signature defaults agree with the ``"network"`` column (a test checks it).

Kinds of input
--------------
``"network"``
    Point-estimate networks whose hidden units a permutation spec describes: MLPs of any
    depth, ConvNets with batch norms, LSTM classifiers (:mod:`bayesfuse.inference.spec`).
``"bnn"``
    Horseshoe BNNs of any depth (:class:`~bayesfuse.models.bnn.HorseshoeBNN`), fused as
    mean-field posteriors, layer by layer (:mod:`bayesfuse.inference.bnn.fusion`).

Each row also names the routine that fuses a state list of each kind (dispatched by
:func:`bayesfuse.core.fuse_states`) and carries the flags the entry points read (``needs_data``,
``aligns_units``, ``baseline``, ``device``), so that no other module tells methods apart by
name. Parameters are declared as scikit-learn declares its estimators'
(``_parameter_constraints``): each key has a type and a constraint
(:mod:`bayesfuse.constraints`), checked in one place. This module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence, cast

from bayesfuse._text import did_you_mean
from bayesfuse.assignments import parse_assignments as _parse_assignments
from bayesfuse.constraints import KEYS, NON_NEGATIVE, Constraint, Either, Fixed, Interval, Options, Param, check

__all__ = [
    "KINDS",
    "METHODS",
    "Interval",
    "Options",
    "Fixed",
    "Either",
    "Param",
    "Method",
    "Variant",
    "PARAMS",
    "resolve",
    "defaults",
    "parse_assignments",
    "names",
    "lookup",
    "canonical",
    "check_keys",
    "check_one_shot",
    "describe",
    "listing",
    "DEVICE_METHODS",
    "check_execution",
]

KINDS = ("network", "bnn")


# --------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Variant:
    """A named setting of some of a method's keys: other defaults, other constraints.

    FedMA matches with PFNM's cost or with NAFI's penalty: one method (``"fedma"``) whose
    ``kl_weight`` the variant ``"pfnm"`` fixes at 0 and the variant ``"nafi"`` defaults to NAFI's.
    """

    defaults: Mapping[str, Any] = field(default_factory=dict)
    constraints: Mapping[str, Constraint] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """A row of the table.

    Attributes
    ----------
    name : str
    summary : str
        One line: what the method does and where it comes from.
    defaults : dict of kind to dict
        For each kind of input the method takes, its keys and their defaults.
    constraints : dict of key to constraint
        Constraints that replace the shared ones of :data:`PARAMS` for this method.
    fusers : dict of kind to str
        For each kind of input, the routine that fuses a list of the clients' state_dicts, as
        ``"module:function"`` (the core's, :func:`bayesfuse.core.fuse_states` looks it up); none
        for a method that needs data.
    needs_data : bool
        The method retrains the clients, so it needs their data, not only their models.
    aligns_units : bool
        The method aligns the clients' hidden units before it averages them (matching or
        transport): networks of any widths, position encodings folded out first. ``False``
        (FedAvg): the clients' entries are averaged as they are, in their own dtype.
    baseline : bool
        A baseline every comparison has anyway: the demo always runs it, Flower has it as its
        own strategy (``FedAvg``).
    device : bool
        Its matching of point-estimate networks can run on a torch device (``device=``).
    featured : bool
        Run by default where methods are compared (the demo's ``--methods``).
    variants : dict of str to Variant
        Named settings of the method's keys (:class:`Variant`).
    aliases : dict of str to str
        Other names of the method with a variant (``"fedma-nafi"``: FedMA with NAFI's penalty).
    summaries : tuple of str
        The kinds of input for which it reads client summaries (:mod:`bayesfuse.summaries`):
        point-estimate networks fused as Laplace posteriors.
    own_heads : bool
        One shot, it assigns every client's hidden unit to one global unit, so that each
        client's own output layer can be kept as a head on the fused network (``head="clients"``,
        :mod:`bayesfuse.inference.client_heads`).
    keeps_widths : bool
        The fused network has the clients' widths (an anchor's, or the clients' own), not widths
        the method chooses; else the layers of a stacked ``nn.LSTM`` / ``nn.GRU``, which keeps one
        width, are matched as one group (:func:`~bayesfuse.inference.spec.tie_stacked_recurrent`).
    """

    name: str
    summary: str
    defaults: Mapping[str, Mapping[str, Any]]
    constraints: Mapping[str, Constraint] = field(default_factory=dict)
    fusers: Mapping[str, str] = field(default_factory=dict)
    needs_data: bool = False
    aligns_units: bool = True
    baseline: bool = False
    device: bool = False
    featured: bool = False
    variants: Mapping[str, Variant] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    summaries: tuple[str, ...] = ()
    own_heads: bool = False
    keeps_widths: bool = False

    def __post_init__(self) -> None:
        expected = () if self.needs_data else self.kinds
        if tuple(self.fusers) != expected:
            raise ValueError(f"method {self.name!r}: fusers for {tuple(self.fusers)}, expected {expected}")
        if not set(self.aliases.values()) <= set(self.variants):
            raise ValueError(f"method {self.name!r}: an alias names an unknown variant")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.defaults)

    @property
    def one_shot(self) -> bool:
        """The method fuses the clients' models alone (no retraining)."""
        return not self.needs_data

    def keys(self, kind: str | None = None) -> tuple[str, ...]:
        """The keys the method takes for ``kind`` (every kind when ``None``), in table order."""
        seen: dict[str, None] = {}
        for k in self.defaults if kind is None else (kind,):
            seen.update(dict.fromkeys(self.defaults[k]))
        return tuple(seen)

    def constraint(self, key: str, variant: str | None = None) -> Constraint:
        if variant is not None and key in self.variants[variant].constraints:
            return self.variants[variant].constraints[key]
        return self.constraints.get(key, PARAMS[key].constraint)

    def preset(self, variant: str | None) -> dict[str, Any]:
        """The keys ``variant`` (None: none) sets over the method's defaults."""
        return {} if variant is None else dict(self.variants[variant].defaults)


#: Every hyper-parameter key any method takes, with its shared constraint and meaning.
PARAMS: dict[str, Param] = {
    p.name: p
    for p in (
        Param(
            "noise_var",
            KEYS["noise_var"],
            "sigma^2: variance of a client's unit around its global unit (PFNM eq. 1); the matching "
            "radius: larger merges more. 'auto': chosen per layer and per block (incoming weights, bias, "
            "outgoing weights) from the models alone, by empirical Bayes on the collapsed marginal",
        ),
        Param(
            "prior_var",
            KEYS["prior_var"],
            "sigma0^2: prior variance of the global units around their prior mean (PFNM: 10); 'auto' as noise_var",
        ),
        Param(
            "gamma0",
            KEYS["gamma0"],
            "IBP mass: expected global units per client; larger makes new global units cheaper (PFNM: 1); "
            "'auto': K / H_J, its maximum-likelihood value",
        ),
        Param(
            "kl_weight",
            KEYS["kl_weight"],
            "NAFI's lambda (eq. 14): weight of the KL penalty added to the matching cost; 0 is PFNM. Networks: "
            "per coordinate of a unit (the matching gets kl_weight / D, so wide layers do not collapse); BNNs: "
            "per unit",
        ),
        Param(
            "cost",
            KEYS["cost"],
            "matching cost: 'pfnm' (Prop. 2 as written), 'marginal' (exact change of the collapsed log posterior), "
            "'auto' (marginal with 'auto' hyper-parameters, else pfnm)",
        ),
        Param(
            "global_weights",
            KEYS["global_weights"],
            "weights of a global unit: the atom's posterior mean, or the average of the units matched to it; "
            "'auto': posterior for one hidden layer, average for deeper networks",
        ),
        Param("n_iter", KEYS["n_iter"], "maximum sweeps (matching) or alternation steps (KL-fusion)"),
        Param(
            "tol",
            KEYS["tol"],
            "matching: stop when a sweep raises the log posterior by less than this many nats per unit; 0 sweeps "
            "until no unit moves",
        ),
        Param(
            "direction",
            KEYS["direction"],
            "order of the layers: bottom-up (FedMA eq. 4) or top-down (PFNM supplement Algorithm 1)",
        ),
        Param(
            "average_outputs",
            KEYS["average_outputs"],
            "scale each global unit's outgoing weights by the share of clients it merges, so fused logits "
            "average the clients' instead of summing them",
        ),
        Param(
            "unit_form",
            KEYS["unit_form"],
            "BNNs: compare and average units as effective weights tau lambda w (invariant to how a client split "
            "the scale) or as the guide's raw coordinates (w, b, log lambda, outgoing)",
        ),
        Param(
            "head",
            KEYS["head"],
            "BNNs: 'shared': one output layer, one softmax over the class-share average of the clients' logits "
            "(a HorseshoeBNN); 'clients': keep each client's output layer on the fused hidden units and mix their "
            "softmaxes by class shares (a HeadMixtureBNN)",
        ),
        Param(
            "prune_kl",
            KEYS["prune_kl"],
            "BNNs: drop each client's units whose incoming weights hold fewer nats of information than this "
            "(KL of their posterior to the prior): units the horseshoe switched off; 0 keeps all. Without "
            "client summaries",
        ),
        Param(
            "prune_share",
            KEYS["prune_share"],
            "BNNs with client summaries: drop each client's least-contributing units while their mean-square "
            "contributions to the layer above, on the client's data, sum to at most this share of the layer's; "
            "0 keeps all",
        ),
        Param(
            "reg",
            KEYS["reg"],
            "KL-fusion: lambda of eq. 9 on KL costs scaled by their standard deviation, larger merges more; "
            "OT: entropic regularisation relative to the largest cost, 0 = exact optimal transport",
        ),
        Param(
            "anchor",
            KEYS["anchor"],
            "OT: the client whose units the others are aligned to (index), or the widest / median one",
        ),
        Param(
            "solver", KEYS["solver"], "solver of KL-fusion's relaxed problem: 'fast' (ADMM), 'cvxpy', or 'auto' (fast)"
        ),
        Param(
            "passes", KEYS["passes"], "FedMA layer-wise passes; more than one is FedMA with communication (section 2.3)"
        ),
    )
}

_MATCHING = dict(noise_var=1.0, prior_var=10.0, gamma0=1.0)
_AUTO_MATCHING = dict(noise_var="auto", prior_var="auto", gamma0="auto")
# tol: a sweep that gains less than 0.1 nats per unit ends the matching; see docs/decisions.md#matching-tol
_NETWORK = dict(cost="auto", n_iter=10, tol=0.1, direction="bottom-up", global_weights="auto", average_outputs=True)
_NAFI_KL = {"network": 1.0, "bnn": 0.01}
# BNNs: pruned units in the effective form, outputs weighted by class shares (bayesfuse.core._fuse_bnn_states).
# KL-fusion's reg: 0.01, not the paper's 0.1; see docs/decisions.md#bnn-kl-fusion-reg
_BNN_UNITS = dict(average_outputs=True, unit_form="effective", prune_kl=1.0, prune_share=1e-3, head="shared")
# matching's noise_var is an absolute variance, set for the guide's raw coordinates;
# see docs/decisions.md#bnn-matching-raw-units
_BNN_MATCHING_UNITS = dict(_BNN_UNITS, unit_form="raw")
_NO_KL = Fixed(0.0, "method='pfnm' has no KL penalty; use method='nafi' for kl_weight > 0")
# the routines that fuse state lists live in the core (bayesfuse.core), which imports this module
_CORE = "bayesfuse.core:"
_MATCHING_FUSERS = {"network": _CORE + "_match_states", "bnn": _CORE + "_matched_bnn_states"}

#: The table. Point-estimate networks: hyper-parameters chosen per layer by empirical Bayes
#: ("auto", benchmarks/bench_fidelity.py); NAFI's KL per coordinate with lambda = 1 (the
#: matching's per-unit weight 1 / D; see docs/decisions.md#nafi-kl-weight). BNN units carry their
#: own posterior variances, so the extra noise variance there is small, and NAFI's weight is per unit.
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "pfnm",
            "PFNM: BBP-MAP matching of hidden units (Yurochkin et al. 2019), layer by layer",
            {
                "network": dict(_AUTO_MATCHING, kl_weight=0.0, **_NETWORK),
                "bnn": dict(_MATCHING, noise_var=0.01, kl_weight=0.0, cost="pfnm", n_iter=10, **_BNN_MATCHING_UNITS),
            },
            constraints={"kl_weight": _NO_KL},
            fusers=_MATCHING_FUSERS,
            device=True,
            featured=True,
            summaries=("network", "bnn"),
            own_heads=True,
        ),
        Method(
            "nafi",
            "NAFI: the PFNM cost plus kl_weight x the KL between a global unit's posteriors (Xiao & Cheng, eq. 14)",
            {
                "network": dict(_AUTO_MATCHING, kl_weight=_NAFI_KL["network"], **_NETWORK),
                "bnn": dict(
                    _MATCHING, noise_var=0.01, kl_weight=_NAFI_KL["bnn"], cost="pfnm", n_iter=10, **_BNN_MATCHING_UNITS
                ),
            },
            fusers=_MATCHING_FUSERS,
            device=True,
            featured=True,
            summaries=("network", "bnn"),
            own_heads=True,
        ),
        Method(
            "fedma",
            "FedMA: match one layer, freeze it, retrain the clients, repeat (Wang et al. 2020); "
            "kl_weight > 0 matches with NAFI's penalty",
            {"network": dict(_MATCHING, kl_weight=0.0, cost="pfnm", n_iter=10, passes=1)},
            needs_data=True,
            variants={
                "pfnm": Variant({"kl_weight": 0.0}, {"kl_weight": _NO_KL}),
                "nafi": Variant({"kl_weight": _NAFI_KL["network"]}),
            },
            aliases={"fedma-nafi": "nafi"},
        ),
        Method(
            "fedavg",
            "one-shot FedAvg: coordinate-wise average weighted by client sizes (identical widths)",
            {"network": {}},
            fusers={"network": _CORE + "_fedavg_states"},
            aligns_units=False,
            baseline=True,
            keeps_widths=True,
        ),
        Method(
            "ot",
            "OT fusion: align each client's units to an anchor's by optimal transport, layer by layer, "
            "then average (Singh & Jaggi 2020, weight-based)",
            {"network": dict(anchor="widest", reg=0.0, n_iter=1000)},
            constraints={"reg": NON_NEGATIVE},
            fusers={"network": _CORE + "_ot_states"},
            keeps_widths=True,
        ),
        Method(
            "kl",
            "KL-fusion of mean-field posteriors with the L2,2,1 regulariser (Claici et al. 2020, eq. 9)",
            {"bnn": dict(reg=0.01, solver="auto", n_iter=20, **_BNN_UNITS)},
            fusers={"bnn": _CORE + "_kl_bnn_states"},
            summaries=("bnn",),
        ),
    )
}


# --------------------------------------------------------------------------- resolving


def _method(method: str) -> Method:
    return METHODS[canonical(method)]


def canonical(name: str, *, aliases: bool = False) -> str:
    """The table's name for ``name``, in any case (``"PFNM"`` -> ``"pfnm"``); with ``aliases``, an
    alias is a name too (``"FedMA-NAFI"`` -> ``"fedma-nafi"``).

    Raises ``ValueError`` for a name the table does not know, listing the known ones and naming
    the closest (``"pfmn"``: did you mean ``'pfnm'``?).
    """
    known = names(aliases=aliases)
    lowered = name.strip().lower() if isinstance(name, str) else name
    if lowered in known:
        return lowered
    hint = did_you_mean(lowered, known) if isinstance(lowered, str) else ""
    raise ValueError(f"unknown method {name!r}: method must be one of {', '.join(known)}{hint}")


def check_one_shot(method: str) -> None:
    """Refuse a method that retrains the clients (``Method.needs_data``) where only their models
    are at hand (``bayesfuse fuse`` and its files), saying where it runs instead (``ValueError``)."""
    m = _method(method)
    if m.needs_data:
        one_shot = " or ".join(names("network", featured=True))
        raise ValueError(
            f"{m.name} retrains each client between layers, so it needs the clients' data, not only "
            f"their files; run it where the data is (bayesfuse.fuse(models, '{m.name}', data=...) or "
            f"`bayesfuse demo --methods {m.name}`), or fuse the files in one shot with {one_shot}"
        )


def check_keys(method: str, given: Mapping[str, Any], *, caller: Callable) -> None:
    """Refuse the keys of ``given`` that ``method`` takes for no kind of input (``ValueError``),
    naming for each the closest of its keys and of the arguments of ``caller``, the function
    whose ``**hyper`` they were passed as: a misspelt argument (``fuse(models,
    class_count=...)``) lands among the hyper-parameters.

    Which keys each kind of input takes is :func:`resolve`'s to check, once the kind is known.
    """
    import inspect

    m = _method(method)
    unknown = sorted(set(given) - set(m.keys()))
    if unknown:
        arguments = [
            p.name
            for p in inspect.signature(caller).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        choices = [*m.keys(), *arguments]
        hints = [did_you_mean(k, choices) for k in unknown]
        hint = (
            "".join(h for h in hints if h)
            if len(unknown) == 1
            else "".join(f" ({k!r}: {h.strip()[1:-1]})" for k, h in zip(unknown, hints) if h)
        )
        raise ValueError(
            f"unknown hyper-parameters {unknown} for method {m.name!r}, and not arguments of "
            f"{caller.__name__}"
            f"{hint}; {m.name}'s hyper-parameters: {', '.join(m.keys()) or 'none'}"
        )


def names(kind: str | None = None, *, aliases: bool = False, **flags: bool | None) -> tuple[str, ...]:
    """Methods that take ``kind`` (any kind when ``None``), optionally filtered on flags of their
    rows (``needs_data=False``, ``baseline=False``, ``featured=True``...; ``None`` ignores one);
    with ``aliases``, the aliases of those methods follow them."""
    rows = [
        m
        for m in METHODS.values()
        if (kind is None or kind in m.defaults)
        and all(value is None or getattr(m, flag) == value for flag, value in flags.items())
    ]
    return tuple(m.name for m in rows) + (tuple(a for m in rows for a in m.aliases) if aliases else ())


def lookup(name: str) -> tuple[Method, str | None]:
    """The row ``name`` names and its variant: ``(row, None)`` for a method's own name, ``(row,
    variant)`` for an alias (``"fedma-nafi"``: ``(METHODS["fedma"], "nafi")``); ``ValueError`` for
    a name the table does not know."""
    name = canonical(name, aliases=True)
    for m in METHODS.values():
        if name in m.aliases:
            return m, m.aliases[name]
    return METHODS[name], None


def defaults(method: str, kind: str = "network") -> dict[str, Any]:
    """The defaults of ``method`` for ``kind`` (a copy)."""
    m = _method(method)
    _check_kind(m, kind)
    return dict(m.defaults[kind])


_KIND_WORDS = {"network": "point-estimate networks", "bnn": "Bayesian networks (HorseshoeBNN posteriors)"}


def _check_kind(m: Method, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind not in m.defaults:
        takes = " and ".join(_KIND_WORDS[k] for k in m.kinds)
        raise ValueError(
            f"method {m.name!r} fuses {takes}, not {_KIND_WORDS[kind]}; methods for "
            f"{_KIND_WORDS[kind]}: {', '.join(names(kind))}"
        )


def resolve(
    method: str, kind: str = "network", given: Mapping[str, Any] | None = None, *, variant: str | None = None
) -> dict[str, Any]:
    """Every hyper-parameter of ``method`` for ``kind``: the given values, checked, over the defaults
    (those of ``variant`` over the method's, with its constraints).

    ``None`` keeps a default. Raises ``ValueError`` for an unknown method or variant, a kind the
    method does not take or an unknown key (naming the known ones), and
    :class:`~bayesfuse.constraints.InvalidParameterError` (a ``ValueError`` and a ``TypeError``)
    for a value of the wrong type or out of its constraint.

    Examples
    --------
    >>> resolve("nafi", "network", {"noise_var": 3})["noise_var"]
    3.0
    """
    m = _method(method)
    method = m.name
    _check_kind(m, kind)
    if variant is not None and variant not in m.variants:
        raise ValueError(
            f"method {method!r} has the variants {', '.join(map(repr, m.variants)) or 'none'}, got {variant!r}"
        )
    table = m.defaults[kind]
    given = {k: v for k, v in (given or {}).items() if v is not None}
    unknown = sorted(set(given) - set(table))
    if unknown:
        elsewhere = [k for k in unknown if k in m.keys()]
        hint = f" ({', '.join(elsewhere)} only for {'/'.join(k for k in m.kinds if k != kind)})" if elsewhere else ""
        if not elsewhere and len(unknown) == 1:
            hint = did_you_mean(unknown[0], table)
        raise ValueError(
            f"unknown hyper-parameters {unknown} for method {method!r} on {_KIND_WORDS[kind]}{hint}; "
            f"known: {', '.join(table) or 'none'}"
        )
    out = dict(table, **m.preset(variant))
    for key, value in given.items():
        out[key] = _checked(m, key, value, variant)
    return out


#: Methods whose matching runs on a torch device (``device=``, ``dtype=``) for point-estimate
#: networks (``Method.device``). Where the arithmetic runs is an execution option, not a
#: hyper-parameter: it is in no method's table and changes a result by round-off only.
DEVICE_METHODS = tuple(m.name for m in METHODS.values() if m.device)
#: The methods whose one-shot fusion of point-estimate networks can keep the clients' own output
#: layers (``head="clients"``): those that assign every client's unit to one global unit.
ONE_SHOT_HEADS = names("network", own_heads=True)


def check_execution(method: str, kind: str | None, device: Any) -> None:
    """Refuse, before any work, a ``device`` given to a method or kind of input (None: not known
    yet) whose fusion runs on the host only, naming :data:`DEVICE_METHODS` (``ValueError``).
    Whether this machine has the device is for
    :func:`~bayesfuse.inference._backend.check_device`; an unknown method is :func:`resolve`'s to
    refuse."""
    m = METHODS.get(method)
    if device is not None and m is not None and (not m.device or kind not in (None, "network")):
        # not None here: a device method is refused only for a kind other than None and "network"
        what = f"method {method!r}" if not m.device else f"{method} on {_KIND_WORDS[cast(str, kind)]}"
        raise ValueError(
            f"device={str(device)!r}: {what} runs on the host only; a device runs the matching of "
            f"{' and '.join(DEVICE_METHODS)} on point-estimate networks (leave device unset)"
        )


def _checked(m: Method, key: str, value: Any, variant: str | None = None) -> Any:
    return check(key, m.constraint(key, variant), value)


def parse_assignments(method: str, items: Iterable[str]) -> dict[str, Any]:
    """``["noise_var=2", "cost=marginal"]`` -> typed values, checked against the keys of the
    method named ``method`` (:func:`bayesfuse.assignments.parse_assignments` on its row).

    Keys of any kind the method takes are accepted here; :func:`resolve` later checks them
    against the kind of the inputs.
    """
    return _parse_assignments(_method(method), items)


def describe(methods: Sequence[str] | None = None, width: int = 100, *, kind: str | None = None) -> str:
    """Plain-text listing of methods, their keys with defaults per kind, constraints and meaning.

    With ``kind``, only the methods that take that kind of input, with its keys and defaults
    (a BNN-only key is not shown for point-estimate networks); ``bayesfuse methods NAME --kind
    KIND`` prints it.
    """
    import textwrap

    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    lines = []
    for name in methods or METHODS:
        m = _method(name)
        if kind is not None and kind not in m.kinds:
            lines.append(
                f"{m.name}: not for {_KIND_WORDS[kind]}; it fuses {' and '.join(_KIND_WORDS[k] for k in m.kinds)}"
            )
            continue
        kinds = m.kinds if kind is None else (kind,)
        lines.append(f"{m.name}: {m.summary}" + (" [needs the clients' data]" if m.needs_data else ""))
        lines.append(f"  inputs: {'; '.join(f'{k}: {_KIND_WORDS[k]}' for k in kinds)}")
        for key in m.keys(kind):
            if isinstance(m.constraint(key), Fixed):
                continue
            values = {k: m.defaults[k][key] for k in kinds if key in m.defaults[k]}
            shown = sorted(set(map(repr, values.values())))
            default = (
                shown[0]
                if len(shown) == 1 and len(values) == len(kinds)
                else ", ".join(f"{k}: {v!r}" for k, v in values.items())
            )
            lines.extend(
                textwrap.wrap(
                    f"{key} = {default}  ({m.constraint(key)})",
                    width,
                    initial_indent=" " * 4,
                    subsequent_indent=" " * 8,
                )
            )
            lines.extend(textwrap.wrap(PARAMS[key].help, width, initial_indent=" " * 8, subsequent_indent=" " * 8))
        if not m.keys(kind):
            lines.append("    (no hyper-parameters)")
    return "\n".join(lines)


def listing(*, one_shot: bool | None = None, width: int = 100) -> str:
    """One entry per method (``one_shot=True``: only those that fuse models alone, as ``bayesfuse
    fuse`` does): its name, the kinds of input it takes and what it does, wrapped at ``width``."""
    import textwrap

    rows = [m for m in METHODS.values() if one_shot is None or m.one_shot == one_shot]
    name_width = max(len(m.name) for m in rows)
    lines = []
    for m in rows:
        text = f"{m.name:<{name_width}}  [{'/'.join(m.kinds)}] {m.summary}" + (
            "; needs the clients' data: bayesfuse.fuse(..., data=) or bayesfuse demo, not bayesfuse fuse"
            if m.needs_data
            else ""
        )
        lines.extend(textwrap.wrap(text, width, initial_indent="  ", subsequent_indent=" " * (4 + name_width)))
    return "\n".join(lines)
