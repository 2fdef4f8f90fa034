"""A Flower app that fuses clients' networks with bayesfuse (matched averaging, FedMA)."""
