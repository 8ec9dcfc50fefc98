"""The executable spec: every planner stage of spec section 4 and both attention directions in
vectorised torch (CPU and CUDA). GPU kernels are tested against these, bit for bit (planner) or
within dtype-aware tolerance (attention)."""

from .attention import attention_backward, attention_forward
from .block_geometry import BlockGeometry, block_geometry, geometry_error_flags
from .builder import build_plan
from .classify import Classification, classify, pack_bits, unpack_bits
from .consumer import ReferenceConsumer
from .csr import allocation_header, exclusive_offsets, materialize_q2k
from .schedule import L2_SECTION_BYTES, forward_schedule, heads_per_section
from .transpose import k2q_counts, materialize_k2q

__all__ = [
    "L2_SECTION_BYTES",
    "BlockGeometry",
    "Classification",
    "ReferenceConsumer",
    "allocation_header",
    "attention_backward",
    "attention_forward",
    "block_geometry",
    "build_plan",
    "classify",
    "exclusive_offsets",
    "forward_schedule",
    "geometry_error_flags",
    "heads_per_section",
    "k2q_counts",
    "materialize_k2q",
    "materialize_q2k",
    "pack_bits",
    "unpack_bits",
]
