"""Mask builders returning int32 endpoints ``[Hmask, nfunc, total_q]`` (re-exported from maskplan-core)."""

from maskplan_core.masks import *  # noqa: F403
from maskplan_core.masks import __all__  # noqa: F401
