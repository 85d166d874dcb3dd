"""flexcomm: flexible gradient communication for data-parallel PyTorch over slow, changing networks."""

from flexcomm.hook import COMPRESSORS, BucketRecord, FlexState, hook, register
from flexcomm.version import __version__

__all__ = ["COMPRESSORS", "BucketRecord", "FlexState", "hook", "register", "__version__"]
