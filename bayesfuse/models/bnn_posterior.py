"""Former path of :mod:`bayesfuse.inference.bnn.posterior`, kept as a re-export (the pure NumPy BNN
fusion code moved from the Pyro models to the algorithms, :mod:`bayesfuse.inference.bnn`)."""

from bayesfuse.inference.bnn.posterior import (  # noqa: F401
    BNNPosterior,
    DeepBNNPosterior,
    HiddenLayer,
    __all__,  # noqa: F401
)
