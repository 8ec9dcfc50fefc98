"""The plan ABI schema: frozen, JSON-serialisable pydantic models.

A third party that wants to consume (or produce) plans reads these models' JSON schema
(``PlanSignature.model_json_schema()``), not our code. The tensors a view carries and their
sparse format are documented in :mod:`maskplan_core.plan`: ``sequence_desc`` is present iff the
plan is varlen; a fixed-length view's descriptor is the closed form of
:func:`maskplan_core.plan.fixed_sequence_desc`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

#: 2: fixed-length views no longer carry ``sequence_desc`` (consumers derive it)
#: 3: ``PayloadLayoutSpec.bit_order``: the signature names the bit order by digest, not by id alone
ABI_VERSION = 3

#: The allocation header (spec 4.5): eight int32 values read once per plan build.
HEADER_FIELDS = (
    "forward_q_rows",
    "forward_partial_nnz",
    "forward_full_nnz",
    "backward_q_rows",
    "backward_k_rows",
    "backward_partial_nnz",
    "backward_full_nnz",
    "error_flags",
)

Direction = Literal["forward", "backward"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Topology(_Frozen):
    """Block geometry and CTA topology of one consumer view."""

    tile_m: int = Field(gt=0, description="Q rows per block (the M of the score tile).")
    tile_n: int = Field(gt=0, description="K columns per block (the N of the score tile).")
    q_stage: int = Field(1, gt=0, description="Q tiles in flight per CTA.")
    cta_group_size: Literal[1, 2] = Field(1, description="CTAs cooperating on one MMA.")
    cluster_axis: Literal["none", "m", "n"] = "none"
    pack_gqa: bool = False
    qhead_per_kvhead: int = Field(1, gt=0)


class PayloadLayoutSpec(_Frozen):
    """Shape and identity of the packed predicate payload of one partial block."""

    layout_id: str = Field(description="Versioned name of the element -> (subtile, group, word, bit) map.")
    bit_order: str = Field(
        pattern=r"^sha256:[0-9a-f]{16}$",
        description=(
            "Digest of that map: 'sha256:' and the first 16 hex digits of the SHA-256 of the tile's "
            "rows and columns (the signature's topology.tile_m, tile_n), then each element's flat "
            "bit index ((subtile * payload_groups + group) * words_per_group + word) * 32 + bit in "
            "row-major (m, n) order, as little-endian int64."
        ),
    )
    physical_subtiles: int = Field(gt=0)
    payload_groups: int = Field(gt=0)
    words_per_group: int = Field(gt=0, description="uint32 words per payload group (padded).")


class SignatureDiff(_Frozen):
    field: str
    expected: object
    actual: object

    def __str__(self) -> str:
        return f"{self.field}: plan has {self.actual!r}, consumer expects {self.expected!r}"


class PlanSignature(_Frozen):
    """What one materialised view is for. Dispatch compares it field by field (spec section 7)."""

    #: a plan of another ABI version fails to parse, naming this field, rather than being read
    #: with this version's meaning of its tensors. Python code may leave it out (it is this
    #: version's); JSON must carry it (:meth:`_json_names_its_version`), and the published schema
    #: says so, so a producer in another language cannot write a signature of no version
    abi_version: Literal[ABI_VERSION] = ABI_VERSION  # type: ignore[valid-type]
    arch_family: str = Field(description="'reference', 'sm90', 'sm100', ...")
    direction: Direction
    kernel_family: str
    topology: Topology
    mma_layout: str
    payload: PayloadLayoutSpec
    scheduler_layout: str
    dq_order_format: Literal["none", "rank_int32"] = "none"

    model_config = ConfigDict(json_schema_extra=lambda schema: schema["required"].insert(0, "abi_version"))

    @model_validator(mode="before")
    @classmethod
    def _json_names_its_version(cls, data, info: ValidationInfo):
        if info.mode == "json" and isinstance(data, dict) and "abi_version" not in data:
            raise ValueError(
                f"abi_version is missing: a signature in JSON names its ABI version (this is {ABI_VERSION})"
            )
        return data

    def diff(self, actual: PlanSignature) -> list[SignatureDiff]:
        """Fields (dotted for nested models) where ``actual`` differs from ``self``."""
        return _diff("", self.model_dump(), actual.model_dump())


def _diff(prefix: str, expected: dict, actual: dict) -> list[SignatureDiff]:
    out: list[SignatureDiff] = []
    for key in expected:
        name = f"{prefix}{key}"
        e, a = expected[key], actual.get(key)
        if isinstance(e, dict) and isinstance(a, dict):
            out.extend(_diff(name + ".", e, a))
        elif e != a:
            out.append(SignatureDiff(field=name, expected=e, actual=a))
    return out
