"""Run the app in-process on Flower's simulation engine (Ray), without a SuperLink.

Usage: python simulate.py [--method pfnm|nafi|fedma] [--rounds 3] [--nodes 10] [--local-epochs 10] [--fedma-passes 1]
       [--second-round none|refit|temperature] [--holdout 0.1] [--summaries]
Prints the test accuracy of the global model after each round (and of FedAvg over as many
rounds on the same clients) and the wall time. ``flwr run .`` runs the same app through a
local SuperLink.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="pfnm", choices=["pfnm", "nafi", "fedma"])
    parser.add_argument("--rounds", type=int, default=3, help="PFNM/NAFI rounds (FedMA sets its own)")
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=10)
    parser.add_argument("--round-epochs", type=int, default=5)
    parser.add_argument(
        "--fedma-passes",
        type=int,
        default=1,
        help="FedMA's layer-wise passes (FedMA with communication when > 1: nodes restart from the global network)",
    )
    parser.add_argument(
        "--second-round",
        default="none",
        choices=["none", "refit", "temperature"],
        help="refit: the last round refits the output layer (PFNM, NAFI, FedMA); temperature (PFNM, NAFI): "
        "it chooses the predictive and its temperature by the nodes' NLL on the examples they kept back (--holdout)",
    )
    parser.add_argument(
        "--holdout",
        type=float,
        default=0.1,
        help="with --second-round temperature: the share of its examples each node keeps back from "
        "training and scores the candidates on (0: it scores them on its training examples)",
    )
    parser.add_argument(
        "--summaries", action="store_true", help="nodes send summaries of their own data (bayesfuse.summarize)"
    )
    args = parser.parse_args()
    # Ray's workers import the app too
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    sys.path.insert(0, str(HERE))
    from bayesfuse_flower.client_app import make_client_app
    from bayesfuse_flower.server_app import RESULTS, make_server_app
    from flwr.simulation import run_simulation

    settings = {
        "method": args.method,
        "num-rounds": args.rounds,
        "num-nodes": args.nodes,
        "local-epochs": args.local_epochs,
        "round-epochs": args.round_epochs,
        "fedma-passes": args.fedma_passes,
        "second-round": args.second_round,
        "summaries": args.summaries,
        "holdout": args.holdout,
    }
    start = time.perf_counter()
    run_simulation(
        server_app=make_server_app(settings),
        client_app=make_client_app(settings),
        num_supernodes=args.nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    print(f"{args.method}, {args.nodes} nodes: wall time {time.perf_counter() - start:.1f} s")
    print(json.dumps(RESULTS, indent=2, default=str))


if __name__ == "__main__":
    main()
