"""Former path of :mod:`bayesfuse.inference.bnn.sites`, kept as a re-export (the pure NumPy BNN
fusion code moved from the Pyro models to the algorithms, :mod:`bayesfuse.inference.bnn`)."""

from bayesfuse.inference.bnn.sites import (  # noqa: F401
    body_state,
    deep_site_shapes,
    GLOBAL_SITES,
    has_heads,
    HEAD_KEYS,
    is_bnn_state,
    layer_sites,
    LayerSites,
    prior_scales,
    Site,
    SITES,
    state_depth,
    state_dims,
    STATE_KEYS,
    state_keys,
    state_sizes,
    UNIT_SITES,
)
from bayesfuse.inference.bnn.sites import __all__  # noqa: F401
