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

    tile_m: int = Field(
        gt=0,
        description=(
            "Q positions per block (the M of the score tile the planner classifies and the payload "
            "covers). With pack_gqa the kernel's tile holds qhead_per_kvhead rows per position."
        ),
    )
    tile_n: int = Field(gt=0, description="K positions per block (the N of the score tile).")
    q_stage: int = Field(1, gt=0, description="Q tiles in flight per CTA.")
    cta_group_size: Literal[1, 2] = Field(1, description="CTAs cooperating on one MMA.")
    cluster_axis: Literal["none", "m", "n"] = Field(
        "none",
        description=(
            "The axis along which a cluster's CTAs split one tile (its payload subtiles): 'm' (Q rows), "
            "'n' (K columns), or 'none' (no cluster splits the tile)."
        ),
    )
    pack_gqa: bool = Field(
        False,
        description=(
            "Forward view only: the q heads of one kv head share each tile (so Hmask is 1), the work "
            "queue names the kv head, and a payload bit guards one (position, key) for every packed head."
        ),
    )
    qhead_per_kvhead: int = Field(
        1,
        gt=0,
        description=(
            "num_heads_q / num_heads_kv of the problem. With pack_gqa the packed tile's rows per "
            "position, and a planner requires it to equal the geometry's; otherwise a label."
        ),
    )


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
    physical_subtiles: int = Field(gt=0, description="Subtiles of one partial block's payload (dim 1).")
    payload_groups: int = Field(
        gt=0, description="Groups per subtile (dim 2): typically the consumer threads that hold its bits."
    )
    words_per_group: int = Field(
        gt=0,
        description=(
            "uint32 words per payload group (dim 3, padded; stored as int32). Bit b of a word is "
            "(word >> b) & 1; 1 means visible. Bits no element maps to are 0."
        ),
    )


class SignatureDiff(_Frozen):
    """One field in which a plan's signature differs from what a consumer expects
    (:meth:`PlanSignature.diff`): its dotted name, the consumer's value and the plan's."""

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
    abi_version: Literal[ABI_VERSION] = Field(  # type: ignore[valid-type]
        ABI_VERSION, description="The plan ABI version whose tensor meanings the view follows."
    )
    arch_family: str = Field(description="'reference', 'sm90', 'sm100', ...")
    direction: Direction = Field(
        description=(
            "'forward': a Q-major view (rows are Q blocks, entries K blocks) with fwd_work_desc; "
            "'backward': a K-major (K2Q) view (rows are K blocks, entries Q blocks) with dq_write_order."
        )
    )
    kernel_family: str = Field(description="The consumer kernel the view is made for; compared as a name.")
    topology: Topology
    mma_layout: str = Field(description="The MMA whose accumulator ownership the payload follows; a name.")
    payload: PayloadLayoutSpec
    scheduler_layout: str = Field(
        description=(
            "How the consumer's kernels take the view's work, compared as a name: for a forward view "
            "the fwd_work_desc queue's format and order rule; for a backward view the K-major grid's."
        )
    )
    dq_order_format: Literal["none", "rank_int32"] = Field(
        "none",
        description=(
            "'rank_int32' (backward views): dq_write_order / dq_write_order_full hold, per entry, the "
            "int32 rank of its K block among every K block reaching that Q block (ascending K); "
            "'none': no dQ order."
        ),
    )

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
