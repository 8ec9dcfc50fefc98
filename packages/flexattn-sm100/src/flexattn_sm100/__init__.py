"""flexattn-sm100: the Blackwell (SM100/SM103) MaskPlan consumer (TMEM payload layout, configs, consumer).

Importing it never imports CuTe DSL: the forward kernel (``fwd_kernel``, ``fwd_softmax``,
``fwd_launch``; compiled for sm_100a) loads on first use. Nothing in this package has run on SM100
hardware (``Sm100Consumer.hardware_verified`` is False).
"""

from ._version import __version__
from .config import BWD_VARIANTS, FWD_VARIANTS, Sm100BwdConfig, Sm100FwdConfig, Sm100Variant
from .consumer import Sm100Consumer
from .heuristics import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, select_bwd_config, select_fwd_config
from .payload_layout import TmemLoadLayout, tmem_layout

__all__ = [
    "BWD_VARIANTS",
    "FWD_VARIANTS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "Sm100BwdConfig",
    "Sm100Consumer",
    "Sm100FwdConfig",
    "Sm100Variant",
    "TmemLoadLayout",
    "__version__",
    "select_bwd_config",
    "select_fwd_config",
    "tmem_layout",
]
