"""Former name of :mod:`bayesfuse.nets.tracing` (permutation specs of torch modules, by tracing),
kept so that ``from bayesfuse.nets.spec import spec_from_module`` still works."""

from bayesfuse.nets.tracing import SUPPORTED, UnsupportedLayerError, spec_from_module, spec_with_encodings

__all__ = ["SUPPORTED", "UnsupportedLayerError", "spec_from_module", "spec_with_encodings"]
