"""FedMA as a Flower strategy (:mod:`bayesfuse.integrations.flower`)."""

from __future__ import annotations

import json
from dataclasses import replace
from logging import ERROR, INFO, WARNING
from typing import Any, Callable, Iterable, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, MetricRecordValues, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from torch import nn

from bayesfuse import methods
from bayesfuse.inference.bias_free import (
    Added,
    added_keys,
    missing_biases,
    with_bias_axes,
)
from bayesfuse.inference.encodings import check_unfoldable
from bayesfuse.inference.fedma import (
    FedMAResult,
    FedMASteps,
    fedma_steps,
    matched_form,
    network_form,
    restart_states,
    state_bytes,
)
from bayesfuse.inference.spec import PermutationSpec, tie_stacked_recurrent
from bayesfuse.integrations.flower.records import _metric_record, record_to_state, state_to_record
from bayesfuse.integrations.flower.strategy import _output_layer, _RefitRound, initial_spec
from bayesfuse.nets.heads import ClientHeads

#: Message types of FedMA's rounds (``@app.train("local")`` / ``@app.train("fedma")`` on clients).
FEDMA_LOCAL = "train.local"
FEDMA_ROUND = "train.fedma"


class _PausedRun:
    """:func:`~bayesfuse.inference.fedma.fedma_steps` paused at each round's retraining jobs.

    A strategy gets the clients' retrained networks one round later, in ``aggregate_train``:
    :meth:`begin` runs the generator to its first request, :meth:`resume` sends it the states and
    runs it to the next. No thread: the generator waits between the strategy's calls.
    """

    def __init__(self, steps: FedMASteps) -> None:
        self._steps = steps
        self.waiting = False

    def _step(self, states: list | None) -> tuple[str, object]:
        try:
            request = next(self._steps) if states is None else self._steps.send(states)
        except StopIteration as stop:
            self.waiting = False
            return "done", stop.value
        except Exception as err:  # reported by the strategy
            self.waiting = False
            return "error", err
        self.waiting = True
        return "jobs", request

    def begin(self) -> tuple[str, object]:
        """Run until the first request (``("jobs", (jobs, frozen))``), or the end (``("done",
        FedMAResult)`` or ``("error", exception)``)."""
        return self._step(None)

    def resume(self, states: list) -> tuple[str, object]:
        """Send the paused request its states and run to the next request or the end."""
        return self._step(list(states))

    def stop(self) -> None:
        """End a paused run."""
        if self.waiting:
            self.waiting = False
            self._steps.close()


class FedMA(_RefitRound):
    """FedMA as a Flower strategy (Wang et al. 2020, Algorithm 1; NAFI Algorithm 2 with ``kl_weight``).

    Rounds, ``passes * (1 + len(spec.groups))`` of them, one more with ``second_round="refit"``
    (:meth:`start` sets ``num_rounds``):

    1. ``train.local`` (:data:`FEDMA_LOCAL`): every sampled node trains its own network and
       replies with its arrays and a MetricRecord holding ``num-examples`` and ``class-counts``.
       The server matches the first hidden group (:func:`bayesfuse.inference.fedma.fedma`).
    2. For each hidden group, ``train.fedma`` (:data:`FEDMA_ROUND`): each node receives its own
       message, the global layers so far and its next layer mapped onto the global units, and a
       ConfigRecord whose ``frozen`` is the JSON list of the entries to keep; it retrains the
       rest and replies. The server matches the next group; after the last one, the output
       layer is the class-count weighted average of the replies and the global network is the
       round's ArrayRecord (so ``Result.arrays``).
    2b. With ``passes > 1`` (FedMA with communication, FedMA section 2.3, as
       ``bayesfuse.fuse(models, "fedma", passes=P, data=...)`` runs it): after a pass, each node
       still in the run receives, in a ``train.fedma`` message whose ``frozen`` is empty, its
       network of its original widths cut out of the global one (each of its units replaced by
       the global unit it was matched to, :func:`~bayesfuse.inference.fedma.restart_states`),
       trains it and replies; the next pass matches the replies as 1. matched the local networks.
       Every ``train.fedma`` ConfigRecord says its pass in ``fedma-pass`` (1, 2, ...).
    3. With ``second_round="refit"``, the refit round (as :class:`MatchedAveraging`'s, and as
       ``bayesfuse.fuse(models, "fedma", rounds=2, data=...)`` simulates it): the server sends the
       global network to the nodes still in the run (none it dropped) in a ``train`` message
       whose ConfigRecord has ``"bayesfuse-round": "output_fit"``; each node answers with
       :func:`~bayesfuse.integrations.flower.records.output_fit_reply`, its Laplace fit of the
       output layer on the FedMA body's features of its own data; the server multiplies the fits
       into the output layer in place of FedMA's class-count average, and the refitted network is
       the round's ArrayRecord. :meth:`laplace` gives it with the output layer's covariance,
       :meth:`client_heads` with the nodes' own fits as heads. With no valid fit the FedMA network
       stays.

    Position-aware neurons: with a ``spec`` whose ``encodings`` are set
    (:func:`bayesfuse.nets.spec.spec_from_module` traces them), the server matches plain units,
    as ``bayesfuse.fuse(models, "fedma", ...)`` does: each reply's encodings are folded into its
    weights at the widths it has (:func:`~bayesfuse.inference.encodings.fold_encodings`, eq. F),
    and every network sent to a node, and the global one, is unfolded for the widths it has
    (eq. U).

    Nodes whose replies fail, never come or do not fit the arrays they were sent are dropped
    from the later rounds and reported (``failed``, ``rejected``, ``dropped``). Only the round
    that ends a pass has a global network (its ArrayRecord): server-side evaluation
    (``evaluate_fn``) runs on ``initial_arrays``, after each pass and after the refit round,
    client-side evaluation after the last round.

    Parameters
    ----------
    spec : PermutationSpec, optional
        The clients' architecture, with its position encodings if any; derived from
        ``initial_arrays`` in :meth:`start` when omitted
        (:func:`~bayesfuse.inference.spec.spec_for_state_dict`, which sees no encodings: give the
        spec traced from the module for position-aware networks). Names that leave a skip
        connection possible are refused there, before any round.
    like : torch.nn.Module, optional
        The clients' network, instead of ``spec``: the spec is traced from it
        (:func:`~bayesfuse.nets.tracing.spec_from_module`, position encodings included).
    example_input : tensor, optional
        An input batch for tracing ``like`` where its input shape cannot be inferred.
    hyper : dict, optional
        The ``"fedma"`` row of :mod:`bayesfuse.methods`: ``noise_var``, ``prior_var``,
        ``gamma0``, ``kl_weight``, ``cost``, ``n_iter`` and ``passes`` (2b. above). Checked
        when the strategy is made.
    class_counts_key : str
        Key of a reply's per-class example counts in its MetricRecord (the output layer's weights).
    second_round : {None, "refit"}
        ``"refit"``: one more round after FedMA's own that refits the output layer (3. above).
    output_prior_precision : float, optional
        The refit's prior precision ``lambda``. None (default): the nodes fit with ``1 / mean(w^2)``
        of the output weights they sent in the local round, times the global layer's fan-in over
        theirs (:func:`~bayesfuse.inference.output_fusion.prior_precision_from_weights`), and the
        server takes the product's ``lambda`` that maximises the evidence of their replies.
    pseudo_count : float, optional
        The smoothing of :meth:`client_heads`' heads (:attr:`~bayesfuse.nets.heads.ClientHeads.pseudo_count`);
        None (default): the heads' own, 1.
    seed : int
        Matching seed. The first round's replies are put in the order of their contents'
        hashes, so neither the arrival order nor the node ids change the result.
    local_message_type, round_message_type : str
        Message types of the first round and of the retraining rounds.
    **kwargs
        Passed to ``flwr.serverapp.strategy.FedAvg`` (sampling of the first round and of the
        evaluation, record keys).

    Attributes
    ----------
    fedma_result : FedMAResult or None
        The finished run's record (matchings, sizes, bytes, history) (its last pass's);
        ``None`` before the end.
    fedma_passes : list of FedMAResult
        Every pass that ended, in order.
    nodes : list of int
        The nodes of the current pass, in the order FedMA indexes its clients.
    failed, rejected : list of (int, str)
        Replies skipped over the run, with the reason.
    dropped : list of int
        Nodes dropped from the later rounds.
    error : Exception or None
        What stopped the run early, if anything (every node lost, say).
    output_covariance : ndarray (G+1, K, G+1, K), (K, G+1, G+1) or None
        After a refit, the posterior covariance of the output layer's weights and bias (the bias
        as the last row): joint, or per class for a layer too wide to solve jointly
        (:func:`~bayesfuse.inference.output_fusion.output_posterior`).
    second_round_report : dict or None
        After a refit: ``kind``, ``prior_precision``, ``bytes_up`` and ``bytes_down`` (per node),
        ``replies``, ``seconds``.
    """

    def __init__(
        self,
        *,
        spec: PermutationSpec | None = None,
        like: nn.Module | None = None,
        example_input: Any = None,
        hyper: dict | None = None,
        class_counts_key: str = "class-counts",
        seed: int = 0,
        second_round: str | None = None,
        output_prior_precision: float | None = None,
        local_message_type: str = FEDMA_LOCAL,
        round_message_type: str = FEDMA_ROUND,
        **kwargs,
    ) -> None:
        settings = methods.resolve("fedma", "network", hyper)
        self.passes = int(settings.pop("passes"))
        if second_round not in (None, "refit"):
            raise ValueError(
                f"unknown second_round={second_round!r} for FedMA; choose None or 'refit' (the "
                "temperature round is MatchedAveraging's)"
            )
        super().__init__(
            spec=spec,
            like=like,
            example_input=example_input,
            class_counts_key=class_counts_key,
            seed=seed,
            output_prior_precision=output_prior_precision,
            **kwargs,
        )
        if self.spec is not None:
            check_unfoldable(self.spec)
        self.second_round = second_round
        self.method = "fedma"
        self.hyper = dict(hyper or {})
        self.settings = settings
        self.local_message_type = local_message_type
        self.round_message_type = round_message_type
        self._run: _PausedRun | None = None
        self._arch = self.spec  # the architecture a run checks its first replies against
        self._refit_round: int | None = None  # the round start() makes the refit
        self._reset(self.spec)

    def _reset(self, spec: PermutationSpec | None) -> None:
        run = getattr(self, "_run", None)
        if run is not None:
            run.stop()
        self._run = None
        self._spec = spec
        # layers without a bias before a batch norm: the server matches them through a zero bias,
        # the nodes' networks hold it in the batch norm (bayesfuse.inference.bias_free)
        self._added: list[Added] = []
        self._keys: list[str] = []  # the nodes' entries, in their order
        self._pending: tuple[list, set, str | None] | None = None  # jobs, frozen, group (None: the restart)
        self._matched = 0
        self._pass = 0  # the pass under way (0-based)
        self._restart_bytes = 0  # the restart rounds' bytes down (their replies are the next pass's uploads)
        self._pass_ends: list[int] = []  # the rounds that ended a pass
        self.fedma_passes: list[FedMAResult] = []
        self._forget_refit()
        self._examples: dict[int, float] = {}
        self.fedma_result: FedMAResult | None = None
        self.nodes: list[int] = []
        self.failed, self.rejected = [], []
        self.dropped: list[int] = []
        self.error: BaseException | None = None

    @property
    def _restart(self) -> bool:
        """Whether the pending round is the restart between two passes (its group is None)."""
        return self._pending is not None and self._pending[2] is None

    @property
    def _final_round(self) -> int | None:
        """The round FedMA's own rounds ended (its last pass's), None before."""
        return self._pass_ends[-1] if self.fedma_result is not None else None

    def num_rounds(self, arrays: ArrayRecord) -> int:
        """The rounds FedMA takes for the network ``arrays``: per pass one local (or restart)
        round and one per hidden group, and the refit round with ``second_round="refit"``.

        Parameters
        ----------
        arrays : ArrayRecord
            A network of the clients' architecture.

        Returns
        -------
        int
        """
        state = record_to_state(arrays)
        spec, _ = tie_stacked_recurrent(initial_spec(self.spec, state), state)
        return self.passes * (1 + len(spec.groups)) + (self.second_round == "refit")

    def summary(self) -> None:
        """Log the strategy's settings (Flower's, then FedMA's)."""
        super().summary()
        log(INFO, "\t└──> FedMA: a local round, then a round per hidden group; hyper-parameters %s", self.settings)
        if self.passes > 1:
            log(INFO, "\t└──> %d passes: each after the first starts from the global network", self.passes)
        if self.second_round == "refit":
            log(INFO, "\t└──> then a round that refits the output layer (second_round='refit')")

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int | None = None,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run FedMA through Flower's ``Strategy.start`` loop.

        Parameters
        ----------
        grid : Grid
        initial_arrays : ArrayRecord
            A network of the clients' architecture: it gives the number of rounds (and the
            spec when the strategy has none). The clients train their own networks in round 1;
            it is not sent.
        num_rounds : int, optional
            ``passes * (1 + len(spec.groups))`` (one more with ``second_round="refit"``), the
            default; any other value is an error.
        timeout : float
            Seconds to wait for the replies of each round.
        train_config, evaluate_config : ConfigRecord, optional
            Sent to the nodes in every training / evaluation message.
        evaluate_fn : callable ``(server_round, arrays) -> MetricRecord or None``, optional
            Server-side evaluation, called before round 1 (on ``initial_arrays``), after each
            pass of FedMA (on its global network), and after the refit round.

        Returns
        -------
        Result
            ``arrays`` is the global network; ``train_metrics_clientapp`` holds each round's
            metrics, FedMA's last one ``global-sizes``, ``fedma-rounds`` (the rounds of all its
            passes, each restart round one: ``passes * (1 + len(spec.groups))``) and
            ``bytes-up``/``bytes-down`` of them all (as :class:`~bayesfuse.federated.FedMARun`
            counts them: the networks each pass matches, and those sent down, the restart
            rounds' included).
        """
        state = record_to_state(initial_arrays)
        # the layers of a stacked LSTM keep one width: matched as one group (tie_stacked_recurrent)
        spec, _ = tie_stacked_recurrent(initial_spec(self.spec, state), state)
        refit = self.second_round == "refit"
        needed = self.passes * (1 + len(spec.groups)) + refit
        if num_rounds is None:
            num_rounds = needed
        elif num_rounds != needed:
            passes = f", {self.passes} times" if self.passes > 1 else ""
            raise ValueError(
                f"FedMA takes {needed} rounds for this network (a local round, then one per hidden "
                f"group {list(spec.groups)}{passes}{', then the refit round' if refit else ''}); "
                f"got num_rounds={num_rounds}"
            )
        self._arch = spec
        self._reset(spec)
        self._refit_round = needed if refit else None
        try:
            return super().start(
                grid=grid,
                initial_arrays=initial_arrays,
                num_rounds=num_rounds,
                timeout=timeout,
                train_config=train_config,
                evaluate_config=evaluate_config,
                evaluate_fn=None if evaluate_fn is None else self._on_global(evaluate_fn),
            )
        finally:
            if self._run is not None:
                self._run.stop()
            self._refit_round = None

    def _on_global(
        self, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None]
    ) -> Callable[[int, ArrayRecord], MetricRecord | None]:
        """``evaluate_fn`` called on ``initial_arrays`` and on each global network, ``None`` in between."""

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0 or self._has_global(server_round):
                return evaluate_fn(server_round, arrays)
            return None  # no global network within a pass

        return evaluate

    def _has_global(self, server_round: int) -> bool:
        """Whether a global network exists after ``server_round``: the rounds that end a pass, and the refit round."""
        if server_round in self._pass_ends:
            return True
        return self._final_round is not None and server_round == self._final_round + 1 == self._refit_round

    # ------------------------------------------------------------------ training rounds

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Round 1: a ``train.local`` message to each sampled node (the config only). Later
        rounds: one ``train.fedma`` message per node still taking part, with its own arrays. The
        refit round: :meth:`configure_output_fit`'s messages, the global network to each sampled node.

        Parameters
        ----------
        server_round : int
        arrays : ArrayRecord
            Not sent: the clients start from their own networks.
        config : ConfigRecord
        grid : Grid

        Returns
        -------
        list of Message
        """
        if server_round == self._refit_round:
            if self.fedma_result is None:
                log(INFO, "configure_train: no refit round to run (FedMA did not finish)")
                return []
            nodes = [n for n in self.nodes if n not in self.dropped]  # FedMA's own, none it dropped
            return self.configure_output_fit(server_round, arrays, config, grid, nodes=nodes)
        if server_round == 1:
            sampled = list(super().configure_train(server_round, arrays, config, grid))  # samples and logs
            content = RecordDict({self.configrecord_key: ConfigRecord(dict(config))})
            return [
                Message(content=content, message_type=self.local_message_type, dst_node_id=m.metadata.dst_node_id)
                for m in sampled
            ]
        if self._pending is None:
            log(
                INFO,
                "configure_train: no FedMA round to run (%s)",
                "the run has ended" if self.fedma_result is not None or self.error is not None else "no local round",
            )
            return []
        jobs, frozen, group = self._pending
        assert self._spec is not None  # set in round 1
        # the server's zero biases: no entry of the nodes'; pieces frozen as their entry
        frozen = {self._spec.whole(k) for k in frozen - added_keys(self._added)}
        round_config = ConfigRecord(
            {
                **dict(config),
                "server-round": server_round,
                "frozen": json.dumps(sorted(frozen)),
                "fedma-pass": self._pass + 1,
            }
        )
        if self._restart:
            log(INFO, "configure_train: %d nodes train their networks cut out of the global one", len(jobs))
        else:
            log(
                INFO,
                "configure_train: %d nodes retrain the layers above group %r (%d entries frozen)",
                len(jobs),
                group,
                len(frozen),
            )
        return [
            Message(
                content=RecordDict(
                    {self.arrayrecord_key: state_to_record(self._encoded(state)), self.configrecord_key: round_config}
                ),
                message_type=self.round_message_type,
                dst_node_id=self.nodes[j],
            )
            for j, state in jobs
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Round 1: start FedMA on the local networks. Later rounds: hand FedMA the retrained
        networks. FedMA matches the next group (metrics only) or, after the last, returns the
        global network.

        Parameters
        ----------
        server_round : int
        replies : iterable of Message

        Returns
        -------
        tuple of (ArrayRecord or None, MetricRecord or None)
            The global network in the round that ends a pass, ``None`` in the others; the
            round's metrics. In the refit round, :meth:`aggregate_output_fit`'s.
        """
        if self._pending_refit is not None and self._pending_refit["round"] == server_round:
            return self.aggregate_output_fit(server_round, replies)
        if server_round == 1:
            return self._aggregate_local(list(replies))
        return self._aggregate_retrained(server_round, list(replies))

    def _aggregate_local(self, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._reset(self._arch)
        spec, good = self._check(self._collect(replies), self._arch)
        if not good:
            self.error = RuntimeError("no node answered the local training round")
            log(
                ERROR,
                "FedMA stopped in round 1: no valid replies (%d failed, %d rejected)",
                len(self.failed),
                len(self.rejected),
            )
            return None, self._nothing_fused()
        assert spec is not None  # a network strategy's check gives the spec its replies share
        spec, _ = tie_stacked_recurrent(spec, good[0].state)  # as start() does, for calls without it
        first = spec.split(good[0].state)  # an entry reading streams side by side: its pieces
        self._keys = list(first)
        self._added = missing_biases(first, spec)
        self._spec = with_bias_axes(spec, self._added) if self._added else spec
        self.nodes = [r.node for r in good]
        self._examples = {r.node: r.num_examples for r in good}
        output = _output_layer(good[0].state)  # the refit round's prior precision and heads
        self._output_weights = [] if output is None else [r.state[output + ".weight"] for r in good]
        self._class_counts = {r.node: r.class_counts for r in good}
        step = self._start_pass([self._plain(r.state) for r in good])
        metrics = {
            "num-examples": float(sum(self._examples.values())),
            "local-replies": len(good),
            "failed-replies": len(self.failed),
            "rejected-replies": len(self.rejected),
        }
        return self._advance(1, step, metrics)

    def _aggregate_retrained(
        self, server_round: int, replies: list[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._pending is None or (self._run is None and not self._restart):
            log(WARNING, "aggregate_train: round %d has no FedMA step to take; replies ignored", server_round)
            return None, None
        jobs, _, _ = self._pending
        by_node = {m.metadata.src_node_id: m for m in replies}
        n_failed, n_rejected, examples = len(self.failed), len(self.rejected), 0.0
        updated: list[dict | None] = []
        for j, sent in jobs:
            node = self.nodes[j]
            msg = by_node.get(node)
            if msg is None or msg.has_error():
                reason = "no reply" if msg is None else str(msg.error.reason)
                self.failed.append((node, reason))
                log(WARNING, "node %d: dropped from FedMA (%s)", node, reason)
                updated.append(None)
                continue
            record = msg.content.array_records.get(self.arrayrecord_key)
            problem = f"no ArrayRecord under {self.arrayrecord_key!r}" if record is None else None
            state = None if record is None else record_to_state(record)
            problem = problem or (None if state is None else _mismatch(self._encoded(sent), state, node))
            if problem:
                self._reject(node, f"{problem}; dropped from FedMA")
                updated.append(None)
                continue
            reply_metrics = _metric_record(msg.content) or MetricRecord()
            examples += float(cast(float, reply_metrics.get(self.weighted_by_key, self._examples.get(node, 1.0))))
            updated.append(self._plain(cast(dict, state)))
        n_failed, n_rejected = len(self.failed) - n_failed, len(self.rejected) - n_rejected
        log(INFO, "aggregate_train: Received %s results and %s failures", len(jobs) - n_failed - n_rejected, n_failed)
        self.dropped += [self.nodes[j] for (j, _), u in zip(jobs, updated) if u is None]
        metrics: dict[str, MetricRecordValues] = {
            "num-examples": examples,
            "retrained-replies": len(jobs) - n_failed - n_rejected,
            "failed-replies": n_failed,
            "rejected-replies": n_rejected,
            "fedma-pass": self._pass + 1,
        }
        if self._restart:
            self._restart_bytes += sum(state_bytes(self._encoded(state)) for _, state in jobs)
        if all(u is None for u in updated):
            if self._run is not None:
                self._run.stop()
            self._run, self._pending = None, None
            self.error = RuntimeError(f"every node was lost in round {server_round}")
            log(
                ERROR,
                "FedMA stopped in round %d: no node returned a retrained network (%d failed, %d rejected)",
                server_round,
                n_failed,
                n_rejected,
            )
            return None, MetricRecord(metrics)
        if self._restart:
            return self._next_pass(server_round, [(j, u) for (j, _), u in zip(jobs, updated) if u is not None], metrics)
        assert self._run is not None  # checked above: only the restart round has no run
        return self._advance(server_round, self._run.resume(updated), metrics)

    def _next_pass(
        self, server_round: int, replies: list[tuple[int, dict]], metrics: dict
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Start the next pass on the restart round's networks (``(j, state)``, j indexing the
        nodes of the pass before)."""
        self._matched = 0
        self.nodes = [self.nodes[j] for j, _ in replies]
        return self._advance(server_round, self._start_pass([state for _, state in replies]), metrics)

    def _start_pass(self, states: list[dict]) -> tuple[str, object]:
        """Start a new pass of FedMA (:func:`~bayesfuse.inference.fedma.fedma_steps`, seed ``seed +
        pass``) over ``states``, the plain networks (:meth:`_plain`) of ``nodes`` in order, weighted by their class
        counts where every node reported them; its first step (:meth:`_PausedRun.begin`)."""
        assert self._spec is not None  # set in round 1
        counts = [self._class_counts.get(n) for n in self.nodes]
        stacked = None if any(c is None for c in counts) else np.stack(cast(list[np.ndarray], counts))
        steps = fedma_steps(states, self._spec, class_counts=stacked, seed=self.seed + self._pass, **self.settings)
        self._run = _PausedRun(steps)
        return self._run.begin()

    def _advance(
        self, server_round: int, step: tuple[str, object], metrics: dict
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's outcome from FedMA's next step: the next jobs, the end, or an error."""
        kind, value = step
        self._pending = None
        metrics.setdefault("fedma-pass", self._pass + 1)
        if kind == "jobs":
            jobs, frozen = cast(tuple[list, set], value)
            assert self._spec is not None  # set in round 1, with the run
            group = self._spec.groups[self._matched]
            self._matched += 1
            self._pending = (jobs, frozen, group)
            width = self._spec.sizes(jobs[0][1])[group]
            log(INFO, "\t└──> FedMA matched group %r: %d global units", group, width)
            return None, MetricRecord({**metrics, "matched-groups": self._matched, "global-size": width})
        self._run = None
        if kind == "error":
            error = cast(BaseException, value)
            self.error = error
            raise error
        plain = cast(FedMAResult, value)
        assert self._spec is not None  # set in round 1, with the run
        # the position-aware global network (eq. U), as run_fedma's result holds it
        result = replace(plain, state_dict=self._encoded(plain.state_dict))
        self.fedma_passes.append(result)
        self._pass_ends.append(server_round)
        if self._pass + 1 < self.passes:  # FedMA with communication: the next pass starts from the global network
            self._pass += 1
            self._pending = (restart_states(plain, self._spec, len(self.nodes)), set(), None)  # the restart
            log(
                INFO,
                "\t└──> FedMA pass %d finished: global sizes %s; pass %d starts from the global network",
                self._pass,
                result.sizes,
                self._pass + 1,
            )
            metrics["global-sizes"] = [int(s) for s in result.sizes.values()]
            return state_to_record(result.state_dict), MetricRecord(metrics)
        self.fedma_result = result
        log(INFO, "\t└──> FedMA finished: global sizes %s, %d nodes dropped", result.sizes, len(self.dropped))
        metrics.update(
            {
                "global-sizes": [int(s) for s in result.sizes.values()],
                "fedma-rounds": server_round,
                "bytes-up": sum(p.bytes_up for p in self.fedma_passes),
                "bytes-down": sum(p.bytes_down for p in self.fedma_passes) + self._restart_bytes,
                "dropped-nodes": len(self.dropped),
            }
        )
        return state_to_record(result.state_dict), MetricRecord(metrics)

    def _plain(self, state: dict) -> dict:
        """A node's network with its position encodings, if any, folded in (eq. F; float64, as
        run_fedma's), and a zero bias on each layer without one before a batch norm."""
        assert self._spec is not None  # set in round 1
        return matched_form(state, self._spec, self._added)

    def _encoded(self, state: dict) -> dict:
        """A plain network as the position-aware one of its widths (eq. U), with the nodes' own
        entries (a zero-bias layer's bias moved into its batch norm)."""
        assert self._spec is not None  # set in round 1
        return network_form(state, self._spec, self._added, self._keys)

    def client_heads(self, like: nn.Module, *, pool: str | None = None) -> ClientHeads:
        """After the refit round, the refitted network predicting with the nodes' own output fits:
        a :class:`~bayesfuse.nets.heads.ClientHeads` (each head its fit's Laplace posterior, mixed
        by the nodes' class shares, or their geometric pool with ``pool="log"``), as
        ``bayesfuse.fuse(models, "fedma", rounds=2, head="clients")`` would.

        Parameters
        ----------
        like : nn.Module
            A network of the clients' architecture, rebuilt at the global widths.
        pool : {"linear", "log"}, optional
            The heads' mixture (default) or geometric pool.

        Returns
        -------
        ClientHeads

        Raises
        ------
        ValueError
            No refit round has run, or a node that sent a fit reported no class counts in the
            local round.
        """
        return self._refit_heads(like, pool or "linear", "after FedMA's own rounds")

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation of the global network, after the last round only (the refit
        round's, with ``second_round="refit"``).

        Parameters
        ----------
        server_round : int
        arrays : ArrayRecord
        config : ConfigRecord
        grid : Grid

        Returns
        -------
        list of Message
        """
        last = self._refit_round if self._refit_round is not None else self._final_round
        if self.fedma_result is None or server_round != last:
            return []
        return super().configure_evaluate(server_round, arrays, config, grid)


def _mismatch(sent: dict, state: dict, node: int) -> str | None:
    """Why a retrained network cannot be the one sent (other entries or shapes), or ``None``."""
    if set(state) != set(sent):
        return f"node {node}: entries {sorted(set(state) ^ set(sent))[:4]} differ from the ones sent"
    for k, v in sent.items():
        if np.shape(state[k]) != np.shape(v):
            return f"node {node}: {k!r} has shape {np.shape(state[k])}, it was sent with {np.shape(v)}"
    return None
