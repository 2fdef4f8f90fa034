"""Former path of :mod:`bayesfuse.inference.bnn.sites`, kept as a re-export (the pure NumPy BNN
fusion code moved from the Pyro models to the algorithms, :mod:`bayesfuse.inference.bnn`)."""

from bayesfuse.inference.bnn.sites import (  # noqa: F401
    GLOBAL_SITES,
    HEAD_KEYS,
    SITES,
    STATE_KEYS,
    UNIT_SITES,
    LayerSites,
    Site,
    __all__,  # noqa: F401
    body_state,
    deep_site_shapes,
    has_heads,
    is_bnn_state,
    layer_sites,
    prior_scales,
    state_depth,
    state_dims,
    state_keys,
    state_sizes,
)
