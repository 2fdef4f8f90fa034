import os

os.environ.setdefault("MPLBACKEND", "Agg")  # plots in tests never need a display
