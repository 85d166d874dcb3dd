"""flexcomm: flexible gradient communication for data-parallel PyTorch over slow, changing networks."""

from flexcomm.hook import COMPRESSORS, BucketRecord, FlexState, hook

__version__ = "0.1.0"

__all__ = ["COMPRESSORS", "BucketRecord", "FlexState", "hook", "__version__"]
