"""maskplan-core: the MaskPlan ABI (schema, validation, plan objects) and the pure-torch reference.

Depends on torch and pydantic only; never imports CuTe DSL.
"""

from . import masks
from .consumer import (
    ENTRY_POINT_GROUP,
    AttentionOutputs,
    Consumer,
    KernelConfig,
    KernelConsumer,
    ViewConfig,
    ViewRequest,
    require_view_signature,
)
from .errors import (
    ConsumerNotFoundError,
    EndpointError,
    FlexAttnError,
    InputTypeError,
    InputValueError,
    MissingBackwardViewError,
    PlanBindingError,
    PlanDtypeError,
    PlanSignatureMismatch,
    ScaleTypeError,
    SeqlenError,
    UnsupportedCallError,
    UnsupportedConfigError,
)
from .geometry import PlanGeometry
from .payload import PayloadLayout, RowMajorLayout, fragment_inverse
from .plan import BlockEntries, MaskPlan, PlanMetadata, PlanView
from .schema import ABI_VERSION, HEADER_FIELDS, PayloadLayoutSpec, PlanSignature, SignatureDiff, Topology
from .validation import validate_plan_inputs

__version__ = "0.1.0"

__all__ = [
    "ABI_VERSION",
    "ENTRY_POINT_GROUP",
    "HEADER_FIELDS",
    "AttentionOutputs",
    "BlockEntries",
    "Consumer",
    "ConsumerNotFoundError",
    "EndpointError",
    "FlexAttnError",
    "InputTypeError",
    "InputValueError",
    "KernelConfig",
    "KernelConsumer",
    "MaskPlan",
    "MissingBackwardViewError",
    "PayloadLayout",
    "PayloadLayoutSpec",
    "PlanBindingError",
    "PlanDtypeError",
    "PlanGeometry",
    "PlanMetadata",
    "PlanSignature",
    "PlanSignatureMismatch",
    "PlanView",
    "RowMajorLayout",
    "ScaleTypeError",
    "SeqlenError",
    "SignatureDiff",
    "Topology",
    "UnsupportedCallError",
    "UnsupportedConfigError",
    "ViewConfig",
    "ViewRequest",
    "fragment_inverse",
    "masks",
    "require_view_signature",
    "validate_plan_inputs",
]
