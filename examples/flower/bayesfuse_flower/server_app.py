"""ServerApp: one-shot matched averaging (PFNM/NAFI) or FedMA, reported against one-shot FedAvg."""

from __future__ import annotations

import json
import time

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from bayesfuse._io import atomic_write_text
from bayesfuse.integrations.flower import MatchedAveraging, fedma_server, record_to_state, state_to_record
from bayesfuse.metrics import evaluate
from bayesfuse.nets.predict import predict_proba

from bayesfuse_flower.task import _split, config, fresh_model, model_from_state, settings

RESULTS: dict = {}  # filled by main(); read by tests and printed at the end


def _test_accuracy(cfg, state, seed) -> dict:
    test = _split(seed).test
    m = evaluate(predict_proba(model_from_state(cfg, state), test.x), test.y)
    return {"accuracy": m["accuracy"], "nll": m["nll"]}


def make_server_app(overrides: dict | None = None) -> ServerApp:
    """The ServerApp, with settings ``overrides`` on top of the run config."""
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        main(grid, settings(context, dict(overrides or {})))

    return app


def main(grid: Grid, run: dict) -> None:
    method, seed = str(run.get("method", "pfnm")), int(run.get("seed", 0))
    nodes = int(run.get("num-nodes", 10))
    cfg = config(run)
    start = time.perf_counter()
    if method == "fedma":
        out = fedma_server(grid, min_nodes=nodes, timeout=float(run.get("timeout", 600)), seed=seed)
        fused = record_to_state(out.arrays)
        RESULTS["fedma"] = {**_test_accuracy(cfg, fused, seed), "rounds": out.result.rounds,
                            "sizes": list(out.result.sizes.values()), "failed": out.failed}
    else:
        # One round: each node trains from its own initialisation, the server fuses once.
        initial = state_to_record(fresh_model(cfg, seed).state_dict())
        strategy = MatchedAveraging(method, min_train_nodes=nodes, min_available_nodes=nodes, fraction_evaluate=0.0,
                                    seed=seed)
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=1,
                                timeout=float(run.get("timeout", 600)))
        if 1 not in result.train_metrics_clientapp:
            RESULTS[method] = {"error": "no node replied in time; nothing was fused"}
            print("bayesfuse results:", json.dumps(RESULTS, default=str))
            return
        RESULTS[method] = {**_test_accuracy(cfg, record_to_state(result.arrays), seed),
                           **{k: v for k, v in result.train_metrics_clientapp[1].items()}}
        if bool(run.get("compare-fedavg", True)):
            # the same local training, averaged coordinate-wise (clients' seeds are the same)
            avg = FedAvg(min_train_nodes=nodes, min_available_nodes=nodes, fraction_evaluate=0.0)
            baseline = avg.start(grid=grid, initial_arrays=initial, num_rounds=1,
                                 timeout=float(run.get("timeout", 600)))
            RESULTS["fedavg"] = _test_accuracy(cfg, record_to_state(baseline.arrays), seed)
    RESULTS["seconds"] = time.perf_counter() - start
    print("bayesfuse results:", json.dumps(RESULTS, default=str))
    if run.get("results-file"):
        atomic_write_text(run["results-file"], json.dumps(RESULTS, indent=2, default=str) + "\n", overwrite=True)


app = make_server_app()
