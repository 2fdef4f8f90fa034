"""Former path of :mod:`bayesfuse.inference.bnn.units`, kept as a re-export (the pure NumPy BNN
fusion code moved from the Pyro models to the algorithms, :mod:`bayesfuse.inference.bnn`)."""

from bayesfuse.inference.bnn.units import (  # noqa: F401
    DEFAULT_PRUNE_KL,
    EffectiveUnits,
    __all__,  # noqa: F401
    effective_layer,
    effective_units,
    incoming_information,
    informative_units,
    keep_informative,
    split_effective,
    unit_information,
)
