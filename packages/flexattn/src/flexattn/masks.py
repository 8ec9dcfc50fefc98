"""Mask builders returning int32 endpoints ``[Hmask, nfunc, total_q]`` (maskplan-core's, run
eagerly where ``torch.compile`` traces a call to one: :func:`flexattn.planning.untraced`)."""

import maskplan_core.masks as _builders
from maskplan_core.masks import __all__  # noqa: F401

from .planning import untraced

causal = untraced(_builders.causal)
chunked = untraced(_builders.chunked)
document = untraced(_builders.document)
document_ids = untraced(_builders.document_ids)
from_block_mask = untraced(_builders.from_block_mask)
from_dense = untraced(_builders.from_dense)
from_mask_mod = untraced(_builders.from_mask_mod)
prefix_lm = untraced(_builders.prefix_lm)
sliding_window = untraced(_builders.sliding_window)

