"""The consumer protocol: what a kernel package provides so the planner can target it.

A consumer is found through the entry-point group ``maskplan.consumers`` (value: a zero-argument
callable returning a :class:`Consumer`). The facade asks it to :meth:`Consumer.resolve` a
:class:`ViewRequest` per direction; the answer, a :class:`ViewConfig`, is everything the planner
needs (tile geometry, payload layout) plus the :class:`PlanSignature` the view will carry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from .payload import PayloadLayout
from .schema import Direction, PlanSignature

if TYPE_CHECKING:
    import torch

    from .plan import MaskPlan

ENTRY_POINT_GROUP = "maskplan.consumers"


class ViewRequest(BaseModel):
    """What the facade asks a consumer for: one direction of one problem geometry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch_family: str
    compute_capability: tuple[int, int] | None = None
    direction: Direction
    head_dim_qk: int = Field(gt=0)
    head_dim_v: int = Field(gt=0)
    num_heads_q: int = Field(gt=0)
    num_heads_kv: int = Field(gt=0)
    mask_heads: int = Field(gt=0)
    pack_gqa: bool | None = None
    dtype: Literal["float16", "bfloat16", "float32", "float64"]
    varlen: bool


@dataclass(frozen=True)
class ViewConfig:
    """A resolved consumer view: the signature it carries and the payload layout it packs with."""

    signature: PlanSignature
    layout: PayloadLayout

    @property
    def tile_m(self) -> int:
        return self.signature.topology.tile_m

    @property
    def tile_n(self) -> int:
        return self.signature.topology.tile_n


@dataclass(frozen=True)
class AttentionOutputs:
    """THD output ``[total_q, Hq, Dv]``, fp32 LSE ``[Hq, total_q]``, fp32 max logit ``[Hq]`` or None."""

    out: torch.Tensor
    lse: torch.Tensor
    max_logit: torch.Tensor | None


class Consumer(ABC):
    """One attention implementation that consumes plan views.

    Q/K/V reach :meth:`forward` / :meth:`backward` in THD layout (``[total, H, D]``; a fixed BSHD
    tensor is passed as its ``[B*S, H, D]`` view); the plan's geometry says where samples begin.
    """

    name: ClassVar[str]
    arch_families: ClassVar[tuple[str, ...]]
    #: False for consumers compiled but never run on their hardware; resolution reports it.
    hardware_verified: ClassVar[bool] = True

    @abstractmethod
    def resolve(self, request: ViewRequest) -> ViewConfig:
        """Return the view config for ``request`` or raise ``UnsupportedConfigError``."""

    def build_plan(self, mask_func, geometry, forward: ViewConfig, backward: ViewConfig | None) -> MaskPlan:
        """Plan with this consumer's views. The default runs the reference planner (any device);
        a consumer with GPU planner kernels overrides it."""
        from .reference.builder import build_plan

        return build_plan(mask_func, geometry, forward, backward, self.name)

    @abstractmethod
    def forward(
        self, plan: MaskPlan, q, k, v, *, softmax_scale: float, return_max_logit: bool
    ) -> AttentionOutputs: ...

    @abstractmethod
    def backward(
        self, plan: MaskPlan, q, k, v, out, lse, dout, dlse, *, softmax_scale: float, deterministic: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
