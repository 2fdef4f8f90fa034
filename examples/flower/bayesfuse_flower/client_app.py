"""ClientApp: trains locally, retrains FedMA's unfrozen layers, evaluates."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from bayesfuse import summarize
from bayesfuse.integrations.flower import (
    OUTPUT_FIT,
    ROUND_KEY,
    SUMMARY_KEY,
    SUMMARY_META_KEY,
    TEMPERATURE,
    output_fit_reply,
    record_to_state,
    state_to_record,
    summary_to_records,
    temperature_reply,
)
from bayesfuse.metrics import evaluate as score
from bayesfuse.nets.predict import predict_proba
from bayesfuse_flower.task import config, fresh_model, load_data, model_from_state, settings, train


def _node_data(context: Context, run: dict, held: bool = False):
    """The node's partition and its examples: those it trains on, or (``held``) those it keeps
    back from training for the temperature round, which scores candidates on them."""
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    holdout = float(run["holdout"]) if run["second-round"] == "temperature" else 0.0
    return pid, load_data(pid, n, int(run["seed"]), holdout, held)


def _reply(msg: Message, model, x, y, with_summary: bool = False) -> Message:
    """The node's arrays and counts; with ``with_summary``, its summary of its own data beside them
    (one pass over ``x, y``; aggregates only), which MatchedAveraging fuses the networks with."""
    metrics = MetricRecord({"num-examples": len(x), "class-counts": np.bincount(y, minlength=10).tolist()})
    content = {"arrays": state_to_record(model.state_dict()), "metrics": metrics}
    if with_summary:
        content[SUMMARY_KEY], content[SUMMARY_META_KEY] = summary_to_records(summarize(model, x, y))
    return Message(RecordDict(content), reply_to=msg)


def make_client_app(overrides: dict | None = None) -> ClientApp:
    """The ClientApp, with settings ``overrides`` on top of the run config."""
    overrides = dict(overrides or {})
    app = ClientApp()

    def own_or_global(msg: Message, context: Context, from_global: bool, with_summary: bool = False) -> Message:
        run = settings(context, overrides)
        pid, (x, y, _) = _node_data(context, run)
        cfg = config(run)
        if from_global:
            model = model_from_state(cfg, record_to_state(msg.content["arrays"]))
            cfg = replace(cfg, epochs=int(run["round-epochs"]))
        else:
            model = fresh_model(cfg, cfg.seed + pid)
        train(model, x, y, replace(cfg, seed=cfg.seed + pid))
        return _reply(msg, model, x, y, with_summary)

    @app.train()
    def train_round(msg: Message, context: Context) -> Message:
        """Matched averaging: round 1 trains the node's own network from its own initialisation
        (separately trained models); later rounds start from the server's fused model. In the
        refit round the node trains nothing: it fits the fused network's output layer on its own
        data and returns the fit; in the temperature round it returns its summed NLL of each
        candidate at each temperature (aggregates only, both)."""
        round_kind = msg.content["config"].get(ROUND_KEY)
        if round_kind in (OUTPUT_FIT, TEMPERATURE):
            run = settings(context, overrides)
            _, (x, y, _) = _node_data(context, run, held=round_kind == TEMPERATURE)
            fused = model_from_state(config(run), record_to_state(msg.content["arrays"]))
            if round_kind == TEMPERATURE:
                reply = temperature_reply(fused, x, y, msg.content["config"], msg.content.array_records)
                return Message(reply, reply_to=msg)
            return Message(output_fit_reply(fused, x, y, msg.content["config"]), reply_to=msg)
        later = "arrays" in msg.content.array_records and int(msg.content["config"].get("server-round", 1)) > 1
        summary = bool(settings(context, overrides).get("summaries", False))
        return own_or_global(msg, context, later, summary and bool(msg.content["config"].get("send-summary", True)))

    @app.train("local")
    def fedma_local(msg: Message, context: Context) -> Message:
        """FedMA, round 0: train the node's own network."""
        return own_or_global(msg, context, False)

    @app.train("fedma")
    def fedma_round(msg: Message, context: Context) -> Message:
        """FedMA, later rounds: retrain what the server did not freeze."""
        run = settings(context, overrides)
        pid, (x, y, _) = _node_data(context, run)
        cfg = config(run)
        frozen = json.loads(msg.content["config"]["frozen"])
        model = model_from_state(cfg, record_to_state(msg.content["arrays"]))
        train(
            model,
            x,
            y,
            replace(cfg, epochs=int(run["round-epochs"]), seed=cfg.seed + 100 * len(frozen) + pid),
            frozen=frozen,
        )
        return _reply(msg, model, x, y)

    @app.evaluate()
    def evaluate_round(msg: Message, context: Context) -> Message:
        run = settings(context, overrides)
        _, (x, y, _) = _node_data(context, run)
        model = model_from_state(config(run), record_to_state(msg.content["arrays"]))
        m = score(predict_proba(model, x), y)
        metrics = MetricRecord({"num-examples": len(x), "accuracy": m["accuracy"], "nll": m["nll"]})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


app = make_client_app()
