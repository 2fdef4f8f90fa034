"""ServerApp: matched averaging (PFNM/NAFI) over several rounds or FedMA, reported against FedAvg.

Every strategy runs through Flower's ``Strategy.start`` with a server-side ``evaluate_fn``
(the digits test set), so each round logs its test accuracy.
"""

from __future__ import annotations

import json
import time
from logging import ERROR
from pathlib import Path
from typing import Callable

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result

from bayesfuse import methods
from bayesfuse.integrations.flower import FedMA, MatchedAveraging, metrics_aggregation, record_to_state, state_to_record
from bayesfuse.metrics import evaluate
from bayesfuse.nets.predict import predict_proba
from bayesfuse_flower.task import _split, config, fresh_model, model_from_state, settings

#: The values of the run config's ``method``.
METHODS = ("pfnm", "nafi", "fedma")
#: The values of the run config's ``second-round``: none, or the last round refits the output layer
#: (PFNM, NAFI and FedMA), or chooses the predictive (with summaries: the nodes' own heads among the
#: candidates) and its temperature by the nodes' NLL on examples they kept back from training
#: (PFNM, NAFI).
SECOND_ROUNDS = ("none", "refit", "temperature")

#: The train config entry that, False, tells a node to send no summary (FedAvg's rounds).
SEND_SUMMARY = "send-summary"

RESULTS: dict = {}  # filled by main(); read by tests and printed at the end


def method_error(method: object) -> str | None:
    """Why ``method`` (the run config's) is not one this app runs, in one line; ``None`` when it is.

    Parameters
    ----------
    method : object
        The run config's ``method``.

    Returns
    -------
    str or None
    """
    if isinstance(method, str) and method in METHODS:
        return None
    return (
        f"unknown method {method!r} in the run config: choose one of {', '.join(METHODS)} "
        f"(e.g. --run-config 'method=\"fedma\"')"
    )


def make_evaluate_fn(cfg, seed: int) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Server-side evaluation on the digits test set, for ``Strategy.start(evaluate_fn=...)``.

    Parameters
    ----------
    cfg : TrainConfig
        The clients' network settings (the fused model may be wider).
    seed : int
        The data split's seed.

    Returns
    -------
    callable ``(server_round, arrays) -> MetricRecord``
        ``accuracy`` and ``nll`` of the global model.
    """

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        test = _split(seed).test
        m = evaluate(predict_proba(model_from_state(cfg, record_to_state(arrays)), test.x), test.y)
        return MetricRecord({"accuracy": float(m["accuracy"]), "nll": float(m["nll"])})

    return evaluate_fn


def fedavg_baseline(nodes: int) -> FedAvg:
    """FedAvg on the same nodes; ``class-counts`` summed, not averaged like the other metrics.

    Parameters
    ----------
    nodes : int
        Nodes to train on in every round.

    Returns
    -------
    FedAvg
    """
    return FedAvg(
        min_train_nodes=nodes,
        min_available_nodes=nodes,
        fraction_evaluate=0.0,
        train_metrics_aggr_fn=metrics_aggregation(("class-counts",)),
    )


def make_server_app(overrides: dict | None = None) -> ServerApp:
    """The ServerApp, with settings ``overrides`` on top of the run config.

    Parameters
    ----------
    overrides : dict, optional

    Returns
    -------
    ServerApp
    """
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        main(grid, settings(context, dict(overrides or {})))

    return app


def _report(result: Result) -> dict:
    """The final test metrics, the accuracy after each evaluated round, the last round's train metrics."""
    evaluated = result.evaluate_metrics_serverapp
    if not evaluated:
        return {}
    last = evaluated[max(evaluated)]
    out = {
        "accuracy": last["accuracy"],
        "nll": last["nll"],
        "accuracy-by-round": {r: round(float(m["accuracy"]), 4) for r, m in sorted(evaluated.items())},
    }
    if result.train_metrics_clientapp:
        out.update(result.train_metrics_clientapp[max(result.train_metrics_clientapp)])
    return out


def _laplace_report(strategy: FedMA | MatchedAveraging, cfg, seed: int) -> dict:
    """Test accuracy and NLL of the refitted network's probit predictive (its output layer's Laplace)."""
    test = _split(seed).test
    m = evaluate(predict_proba(strategy.laplace(fresh_model(cfg, seed)), test.x), test.y)
    return {"accuracy": float(m["accuracy"]), "nll": float(m["nll"])}


def main(grid: Grid, run: dict) -> None:
    """Run the configured method (and FedAvg for comparison) and report the test accuracy.

    A ``method`` the app does not know ends the run with one error line.

    Parameters
    ----------
    grid : Grid
    run : dict
        The run config (:data:`bayesfuse_flower.task.DEFAULTS` and its overrides).
    """
    RESULTS.clear()
    method = run.get("method", "pfnm")
    error = method_error(method)
    second = run.get("second-round", "none")
    if error is None and second not in SECOND_ROUNDS:
        error = (
            f"unknown second-round {second!r} in the run config: choose one of {', '.join(SECOND_ROUNDS)} "
            f"(e.g. --run-config 'second-round=\"refit\"')"
        )
    if error is None and second == "temperature" and methods.METHODS[method].needs_data:
        error = f"second-round 'temperature' is for pfnm and nafi; {method} takes 'none' or 'refit'"
    if error:
        log(ERROR, error)
        return
    seed, nodes = int(run.get("seed", 0)), int(run.get("num-nodes", 10))
    timeout = float(run.get("timeout", 600))
    cfg = config(run)
    evaluate_fn = make_evaluate_fn(cfg, seed)
    # clients train from their own initialisations in round 1; this network fixes the architecture
    initial = state_to_record(fresh_model(cfg, seed).state_dict())
    start = time.perf_counter()
    if methods.METHODS[method].needs_data:  # FedMA: retrains the clients between layers
        fedma = FedMA(
            min_train_nodes=nodes,
            min_available_nodes=nodes,
            fraction_evaluate=0.0,
            seed=seed,
            second_round="refit" if second == "refit" else None,
            hyper={"passes": int(run.get("fedma-passes", 1))},
        )
        result = fedma.start(grid=grid, initial_arrays=initial, timeout=timeout, evaluate_fn=evaluate_fn)
        rounds = fedma.num_rounds(initial)
        if fedma.fedma_result is None:
            RESULTS[method] = {"error": f"FedMA did not finish ({fedma.error or 'no node replied in time'})"}
        else:
            last = next(m for m in result.train_metrics_clientapp.values() if "fedma-rounds" in m)  # FedMA's last round
            RESULTS[method] = {
                **_report(result),
                "sizes": list(fedma.fedma_result.sizes.values()),
                "fedma-passes": len(fedma.fedma_passes),
                "fedma-rounds": last["fedma-rounds"],
                "fedma-bytes-up": last["bytes-up"],
                "fedma-bytes-down": last["bytes-down"],
                "failed": fedma.failed,
                "rejected": fedma.rejected,
                "dropped": fedma.dropped,
            }
            if fedma.output_covariance is not None:  # the refit round ran: the probit predictive too
                RESULTS[method]["laplace"] = _laplace_report(fedma, cfg, seed)
    else:
        # round 1 fuses separately trained networks; later rounds retrain the fused one and fuse again
        rounds = int(run.get("num-rounds", 3))
        strategy = MatchedAveraging(
            method,
            min_train_nodes=nodes,
            min_available_nodes=nodes,
            fraction_evaluate=0.0,
            seed=seed,
            second_round=None if second == "none" else second,
        )
        result = strategy.start(
            grid=grid, initial_arrays=initial, num_rounds=rounds, timeout=timeout, evaluate_fn=evaluate_fn
        )
        if not result.train_metrics_clientapp:
            RESULTS[method] = {"error": "no node replied in time; nothing was fused"}
        else:
            RESULTS[method] = _report(result)
            if strategy.output_covariance is not None:  # the refit round ran: the probit predictive too
                RESULTS[method]["laplace"] = _laplace_report(strategy, cfg, seed)
            report = strategy.second_round_report or {}
            if report.get("kind") == "temperature":  # the candidate kept, at its temperature
                test = _split(seed).test
                m = evaluate(predict_proba(strategy.tempered(fresh_model(cfg, seed)), test.x), test.y)
                RESULTS[method]["tempered"] = {
                    "candidate": report["candidate"],
                    "temperature": report["temperature"],
                    **{k: float(m[k]) for k in ("accuracy", "nll", "ece")},
                }
    RESULTS["seconds"] = time.perf_counter() - start
    if bool(run.get("compare-fedavg", True)):
        # as many rounds, the same local training (clients' seeds are the same), averaged coordinate-wise
        # FedAvg reads one ArrayRecord per reply: the nodes send it no summary
        baseline = fedavg_baseline(nodes).start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=rounds,
            timeout=timeout,
            evaluate_fn=evaluate_fn,
            train_config=ConfigRecord({SEND_SUMMARY: False}),
        )
        RESULTS["fedavg"] = _report(baseline)
    print("bayesfuse results:", json.dumps(RESULTS, default=str))
    if run.get("results-file"):
        path = Path(run["results-file"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")


app = make_server_app()
