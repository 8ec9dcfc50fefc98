"""flexattn-sm90: the Hopper MaskPlan consumer (WGMMA payload layout, configs, consumer).

Importing it never imports CuTe DSL: the kernels (``fwd_*``, ``bwd_*``) load it on first use.
"""

from ._version import __version__
from .config import Sm90BwdConfig, Sm90FwdConfig
from .consumer import Sm90Consumer
from .heuristics import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, select_bwd_config, select_fwd_config
from .payload_layout import (
    WgmmaAccumulatorLayout,
    WgmmaForward128x64Layout,
    WgmmaForward128x128Layout,
    wgmma_layout,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "Sm90BwdConfig",
    "Sm90Consumer",
    "Sm90FwdConfig",
    "WgmmaAccumulatorLayout",
    "WgmmaForward128x64Layout",
    "WgmmaForward128x128Layout",
    "__version__",
    "select_bwd_config",
    "select_fwd_config",
    "wgmma_layout",
]
