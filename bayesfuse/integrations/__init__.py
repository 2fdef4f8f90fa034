"""Adapters to federated-learning runtimes; each needs its optional extra (``bayesfuse[flower]``)."""
