"""Former path of :mod:`bayesfuse.inference.bnn.fusion`, kept as a re-export (the pure NumPy BNN
fusion code moved from the Pyro models to the algorithms, :mod:`bayesfuse.inference.bnn`)."""

from bayesfuse.inference.bnn.fusion import (  # noqa: F401
    HEAD_KEYS,
    BNNFusion,
    __all__,  # noqa: F401
    client_heads,
    fuse_bnn_posteriors,
    kl_units,
    matched_units,
    membership,
    output_shares,
    share_mixture,
)
