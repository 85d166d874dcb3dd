"""flexcomm: flexible gradient communication for data-parallel PyTorch over slow, changing networks."""

from flexcomm.hook import hook, register
from flexcomm.rendezvous import init_process_group
from flexcomm.options import COMPRESSORS, FlexOptions
from flexcomm.state import BucketRecord, FlexState
from flexcomm.version import __version__

__all__ = ["COMPRESSORS", "BucketRecord", "FlexOptions", "FlexState", "hook", "init_process_group", "register", "__version__"]
