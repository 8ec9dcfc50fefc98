"""The consumer protocol: what a kernel package provides so the planner can target it.

A consumer is found through the entry-point group ``maskplan.consumers`` (value: a zero-argument
callable returning a :class:`Consumer`). The facade asks it to :meth:`Consumer.resolve` a
:class:`ViewRequest` per direction; the answer, a :class:`ViewConfig`, is everything the planner
needs (tile geometry, payload layout) plus the :class:`PlanSignature` the view will carry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from .errors import (
    ConsumerNotFoundError,
    InputTypeError,
    InputValueError,
    PlanSignatureMismatch,
    UnsupportedConfigError,
    warn_caller,
)
from .payload import PayloadLayout
from .schema import Direction, PlanSignature, Topology

if TYPE_CHECKING:
    from .geometry import PlanGeometry
    from .plan import MaskPlan, PlanView

ENTRY_POINT_GROUP = "maskplan.consumers"
#: the input dtypes of the attention kernels, by the name their configs use
KERNEL_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


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

    @classmethod
    def for_geometry(
        cls, g: PlanGeometry, direction: Direction, arch_family: str, *,
        compute_capability: tuple[int, int] | None = None, pack_gqa: bool | None = None,
    ) -> ViewRequest:  # fmt: skip
        """The request the facade makes for the problem ``g`` (from :func:`validate_plan_inputs`).
        ``pack_gqa`` is the caller's choice, not part of the geometry (a built view keeps it, as
        ``view.signature.topology.pack_gqa``)."""
        return cls(
            arch_family=arch_family, compute_capability=compute_capability, direction=direction,
            head_dim_qk=g.head_dim_qk, head_dim_v=g.head_dim_v, num_heads_q=g.num_heads_q,
            num_heads_kv=g.num_heads_kv, mask_heads=g.mask_heads, pack_gqa=pack_gqa,
            dtype=str(g.dtype).removeprefix("torch."), varlen=g.varlen,
        )  # fmt: skip


def require_layout_tiles(layout: PayloadLayout, topology: Topology, who: str) -> None:
    """``layout`` packs the tiles ``topology`` classifies (a payload of other tiles would be read
    past, or short of, its bits)."""
    if (layout.tile_m, layout.tile_n) != (topology.tile_m, topology.tile_n):
        raise InputValueError(
            f"{who}: the layout {layout!r} packs {layout.tile_m}x{layout.tile_n} tiles but the "
            f"signature's topology tiles {topology.tile_m}x{topology.tile_n}"
        )


@dataclass(frozen=True)
class ViewConfig:
    """A resolved consumer view: the signature it carries and the payload layout it packs with."""

    signature: PlanSignature
    layout: PayloadLayout

    def __post_init__(self):
        # the planner tiles by the signature's topology and packs with the layout, so they must agree
        # before it runs (PlanView checks the payload spec against the layout)
        require_layout_tiles(self.layout, self.signature.topology, "ViewConfig")

    @property
    def tile_m(self) -> int:
        return self.signature.topology.tile_m

    @property
    def tile_n(self) -> int:
        return self.signature.topology.tile_n


@dataclass(frozen=True)
class AttentionOutputs:
    """THD output ``[total_q, Hq, Dv]`` in q's dtype; LSE ``[Hq, total_q]`` and max logit ``[Hq]`` (or
    None), both fp32 (fp64 for fp64 inputs)."""

    out: torch.Tensor
    lse: torch.Tensor
    max_logit: torch.Tensor | None


class Consumer(ABC):
    """One attention implementation that consumes plan views.

    Q/K/V reach :meth:`forward` / :meth:`backward` in THD layout (``[total, H, D]``; a fixed BSHD
    tensor is passed as its ``[B*S, H, D]`` view), except a fixed-length ``[B, S, H, D]`` tensor
    that has no such view (its samples are not ``S`` rows apart, e.g. a view of ``[B, H, S, D]``):
    that one is passed as it is, for the consumer to read in place or to take as :func:`thd`.
    The plan's geometry says where samples begin. Outputs and gradients are THD.
    """

    name: ClassVar[str]
    arch_families: ClassVar[tuple[str, ...]]
    #: False for consumers compiled but never run on their hardware; resolution reports it.
    hardware_verified: ClassVar[bool] = True

    @abstractmethod
    def resolve(self, request: ViewRequest) -> ViewConfig:
        """Return the view config for ``request`` or raise ``UnsupportedConfigError``."""

    #: the module whose ``build_plan_gpu`` (the reference ``build_plan``'s arguments) plans CUDA
    #: endpoints for this consumer, imported on first use (e.g. ``"maskplan_kernels"``, whose kernels
    #: are architecture-neutral), and whose optional ``unserved(geometry, forward, backward)`` says
    #: why its kernels do not build a plan (None where they do); None: the reference planner on
    #: every device
    gpu_planner: ClassVar[str | None] = None

    def build_plan(
        self, mask_func: torch.Tensor, geometry: PlanGeometry, forward: ViewConfig,
        backward: ViewConfig | None,
    ) -> MaskPlan:  # fmt: skip
        """Plan with this consumer's views: CUDA endpoints with :attr:`gpu_planner`'s kernels where
        the consumer names one and they build the plan, else the reference planner (any device),
        which builds the same tensors. Where the kernels would not build it, a warning says why,
        on the GPU and also for endpoints on another device (a plan for the GPU's tiles made on a
        laptop says what the GPU would)."""
        check_view_configs(forward, backward)  # before unserved() reads them (the planners check again)
        on_gpu = mask_func.device.type == "cuda"
        planner = self._gpu_planner(required=on_gpu)
        if planner is not None:
            unserved = getattr(planner, "unserved", lambda *views: None)(geometry, forward, backward)
            if unserved is None and on_gpu:
                with on_device(mask_func.device):
                    return planner.build_plan_gpu(mask_func, geometry, forward, backward, self.name)
            if unserved is not None:
                slower = "(the same tensors as the planner kernels', in a slower build)"
                warn_caller(
                    f"{unserved}: the reference planner builds this plan on {mask_func.device} {slower}"
                    if on_gpu
                    else f"{unserved}: on a GPU the reference planner would build this plan {slower}; on "
                    f"{mask_func.device} it builds every plan"
                )
        from .reference.builder import build_plan

        return build_plan(mask_func, geometry, forward, backward, self.name)

    def _gpu_planner(self, required: bool):
        """:attr:`gpu_planner`'s module; None where there is none, or where it or a module it needs
        is missing (its CuTe DSL, e.g. on a laptop) and the endpoints are not on the GPU: the
        reference planner builds every plan off the GPU, it only misses the note of what the GPU
        would do."""
        if self.gpu_planner is None:
            return None
        try:
            return importlib.import_module(self.gpu_planner)
        except ModuleNotFoundError as e:  # not installed, or a dependency missing (an import bug raises)
            if not required:
                return None
            raise ConsumerNotFoundError(
                f"consumer {self.name!r} plans CUDA endpoints with {self.gpu_planner!r}, which cannot be "
                f"imported ({e}): install {self.name}'s dependencies (the CuTe DSL for flexattn's "
                f"consumers: pip install 'flexattn[sm90]' or '[sm100]')"
            ) from e

    @abstractmethod
    def forward(
        self, plan: MaskPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
        return_max_logit: bool, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
        payload_via_smem: bool | None = None,
    ) -> AttentionOutputs:  # fmt: skip
        """Attention forward for ``plan`` (built for this consumer). ``q``, ``k``, ``v`` are THD
        views with a contiguous head dim and any other strides (e.g. slices of one fused QKV
        tensor), or a fixed-length ``[B, S, H, D]`` tensor that has no THD view, as it is (class
        docstring). ``softmax_scale`` is always a resolved float (the facade turns None into
        ``1 / sqrt(head_dim_qk)``); ``return_max_logit`` asks for the ``[Hq]`` maximum scaled logit
        over visible elements in the result's ``max_logit`` (else None). The result's ``out`` is
        in q's dtype (the facade's fake op under ``torch.compile`` says so), its ``lse``
        ``[Hq, total_q]``. ``out`` (``[total_q, Hq, Dv]``, q's dtype) and ``lse``
        (``[Hq, total_q]``, fp32; fp64 for fp64 inputs), when given, are contiguous, 16-byte aligned
        tensors the results must be written into (and returned). ``flex_attn_func`` never passes
        them; the facade's explicit ``FlexAttentionFwd`` does where the caller's buffers are such
        (else it copies the results into them), so a consumer must accept them. ``payload_via_smem``
        (cuDNN's ``sm90_use_smem_mask_pipeline``) is a speed hint for a consumer that can deliver
        the packed payload either way, staged through SMEM (True) or loaded straight into
        registers (False), None letting it choose; the results are the same, and a consumer
        without the choice ignores it."""

    @abstractmethod
    def backward(
        self, plan: MaskPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None, *, softmax_scale: float,
        deterministic: bool, dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
        dv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Attention backward for ``plan`` (built with backward views): returns ``(dq, dk, dv)``
        shaped like q / k / v as given (THD views, or the fixed-length tensors as they are).
        ``out`` and ``dout`` are like q's layout with Dv; ``lse`` is the forward's ``[Hq,
        total_q]``; ``dlse`` (the LSE's gradient, same layout) is None where the LSE took no
        gradient; ``softmax_scale`` is the resolved float the forward used; ``deterministic`` asks
        for bit-identical dQ from run to run (the plan's ``dq_write_order``). ``dq`` / ``dk`` /
        ``dv``, when given, are contiguous, 16-byte aligned tensors shaped and typed like q / k / v
        that the gradients must be written into (and returned); the facade's ``FlexAttentionBwd``
        passes the caller's buffers that are such (and copies into the others)."""


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which the CUDA ``device`` is the current one (nothing to do where it is, or for
    the CPU). Kernels launched with raw addresses run on the current device, with its context and
    streams: tensors on another GPU (``model.to("cuda:1")`` without ``torch.cuda.set_device``) need
    it switched around their launches. ``cuda`` without an index is the current device."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def capturing(device: torch.device) -> bool:
    """Whether the CUDA ``device``'s current stream (the one a launch on it uses) is capturing a CUDA
    graph; without a device switch when ``device`` is the current one (every forward asks)."""
    with on_device(device):
        return torch.cuda.is_current_stream_capturing()


def thd(t: torch.Tensor) -> torch.Tensor:
    """The ``[total, H, D]`` form of a THD or ``[B, S, H, D]`` tensor: a view where it has one
    (:func:`has_thd_view`), else a contiguous copy."""
    return t.reshape(-1, *t.shape[-2:])


def has_thd_view(t: torch.Tensor) -> bool:
    """Whether a THD or ``[B, S, H, D]`` ``t`` has a ``[total, H, D]`` view: its samples are ``S``
    rows apart (not so a ``[B, H, S, D]`` tensor transposed at B > 1)."""
    return t.dim() == 3 or t.shape[0] <= 1 or t.shape[1] <= 1 or t.stride(0) == t.shape[1] * t.stride(1)


def require_supported(argument: str, value: object, supported: tuple, owner: str) -> None:
    """Raise ``UnsupportedConfigError`` naming ``argument``, its value and the supported values."""
    if value not in supported:
        raise UnsupportedConfigError(
            f"{argument}={value!r} is not supported by {owner}; supported {argument} values: "
            + ", ".join(map(repr, supported)),
            argument,
        )


#: ``field`` metadata of a kernel config's compile-time (``cutlass.Constexpr``) field
CONSTEXPR = {"constexpr": True}


class KernelConfig:
    """Base of a consumer's frozen kernel-config dataclasses: the compile key (its fields marked
    :data:`CONSTEXPR`) and the plan signature a view built for the config carries (spec section 7).
    A subclass sets :attr:`arch_family` and :attr:`mma_layout` and provides ``direction``,
    ``kernel_family``, :meth:`topology`, ``payload_layout``, ``scheduler_layout`` and
    ``dq_order_format``."""

    arch_family: ClassVar[str]
    mma_layout: ClassVar[str]

    def compile_key(self) -> tuple:
        """``(name, value)`` of every compile-time field, in declaration order."""
        return tuple(
            (f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.metadata.get("constexpr")
        )

    def topology(self) -> Topology:
        raise NotImplementedError

    def plan_signature(self) -> PlanSignature:
        """The signature a view built for this config carries."""
        return PlanSignature(
            arch_family=self.arch_family,
            direction=self.direction,
            kernel_family=self.kernel_family,
            topology=self.topology(),
            mma_layout=self.mma_layout,
            payload=self.payload_layout.spec,
            scheduler_layout=self.scheduler_layout,
            dq_order_format=self.dq_order_format,
        )


class KernelConsumer(Consumer):
    """A consumer whose views come from tile heuristics: one request check and dispatch for all.

    Subclasses name what they support and give the two config selectors; each selector takes
    ``head_dim_qk, head_dim_v, dtype, qhead_per_kvhead, varlen`` (the forward one also ``pack_gqa``
    when :attr:`pack_gqa_forward`) and returns a config with ``plan_signature()`` and
    ``payload_layout``.

    ``pack_gqa`` concerns the forward view only: a K-major backward kernel owns one kv head's K
    block and visits the Q blocks of all its q heads in one CTA, so its view is the same either way.
    """

    compute_capabilities: ClassVar[tuple[tuple[int, int], ...]]
    supported_dtypes: ClassVar[tuple[str, ...]]
    supported_head_dims: ClassVar[tuple[tuple[int, int], ...]]
    #: the forward kernel packs the q heads of a kv head into one tile: on request, or where
    #: :meth:`default_pack_gqa` chooses it for pack_gqa=None
    pack_gqa_forward: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def select_forward(**problem): ...

    @staticmethod
    @abstractmethod
    def select_backward(**problem): ...

    def resolve(self, request: ViewRequest) -> ViewConfig:
        """The view config of ``request``, memoised per consumer (requests and configs are
        immutable; a refused request raises every time)."""
        resolved = self.__dict__.setdefault("_resolved", {})
        config = resolved.get(request)
        if config is None:
            config = resolved[request] = self._resolve(request)
        return config

    def _resolve(self, request: ViewRequest) -> ViewConfig:
        self.check_request(request)
        problem = dict(
            head_dim_qk=request.head_dim_qk,
            head_dim_v=request.head_dim_v,
            dtype=request.dtype,
            qhead_per_kvhead=request.num_heads_q // request.num_heads_kv,
            varlen=request.varlen,
        )
        if request.direction == "forward":
            if self.pack_gqa_forward:
                pack = request.pack_gqa
                problem["pack_gqa"] = self.default_pack_gqa(request) if pack is None else pack
            config = self.select_forward(**problem)
        else:
            config = self.select_backward(**problem)
        return ViewConfig(signature=config.plan_signature(), layout=config.payload_layout)

    def default_pack_gqa(self, request: ViewRequest) -> bool:
        """Whether the forward view packs where the caller leaves ``pack_gqa=None``, called only
        on a checked request of a consumer with :attr:`pack_gqa_forward`: never, unless a
        consumer measured packing faster for such a problem (and its kernel takes the group)."""
        return False

    def check_head_dims(self, head_dim_qk: int, head_dim_v: int) -> None:
        """Raise :class:`UnsupportedConfigError` unless this consumer runs these head dims; by
        default those of :attr:`supported_head_dims` (a consumer that also runs others, e.g. on a
        larger kernel, says so here)."""
        head_dims = (head_dim_qk, head_dim_v)
        require_supported("(head_dim_qk, head_dim_v)", head_dims, self.supported_head_dims, self.name)

    def check_request(self, request: ViewRequest) -> None:
        require_supported("arch_family", request.arch_family, self.arch_families, self.name)
        if request.compute_capability is not None:
            cc = tuple(request.compute_capability)
            require_supported("compute_capability", cc, self.compute_capabilities, self.name)
        require_supported("dtype", request.dtype, self.supported_dtypes, self.name)
        if request.num_heads_q % request.num_heads_kv:
            raise UnsupportedConfigError(
                f"num_heads_q={request.num_heads_q} is not a multiple of num_heads_kv={request.num_heads_kv}"
            )
        if request.pack_gqa:
            if not self.pack_gqa_forward:
                raise UnsupportedConfigError(
                    f"pack_gqa=True is not supported by {self.name} yet; supported pack_gqa values: "
                    "None, False",
                    "pack_gqa",
                )
            require_shared_mask_for_pack_gqa(request)
        # last: a consumer's check may warn (head dims run on a larger kernel), and should not before
        # a refusal here (select_forward / select_backward may still refuse after it)
        self.check_head_dims(request.head_dim_qk, request.head_dim_v)


def require_pack_gqa_ratio(qhead_per_kvhead: int, tile_m: int) -> None:
    """PackGQA puts the ``G = Hq / Hkv`` q heads of a kv head in each row block of a ``tile_m``-row
    tile, so ``G`` must divide ``tile_m``."""
    if tile_m % qhead_per_kvhead:
        supported = ", ".join(str(g) for g in range(1, tile_m + 1) if tile_m % g == 0)
        raise UnsupportedConfigError(
            f"pack_gqa=True packs num_heads_q / num_heads_kv = {qhead_per_kvhead} q heads into the "
            f"{tile_m}-row forward tile, which needs a ratio dividing {tile_m} ({supported}); "
            "use pack_gqa=False"
        )


def require_shared_mask_for_pack_gqa(request: ViewRequest | PlanGeometry) -> None:
    """PackGQA puts the q heads of a kv head in one tile's rows, so they must share the mask."""
    if request.mask_heads != 1:
        raise UnsupportedConfigError(
            f"pack_gqa=True packs the q heads of a kv head into one tile, which takes one mask for "
            f"all heads: mask_func has Hmask={request.mask_heads}, PackGQA needs Hmask=1. If its heads "
            "all hold the same mask (masks.from_dense keeps heads held apart, equal or not), pass "
            "mask_func[:1]; else use pack_gqa=False"
        )


def check_view_configs(forward: ViewConfig, backward: ViewConfig | None) -> None:
    """A planner's view arguments are configs (a consumer's ``resolve`` of a request), not requests."""
    for name, config in (("forward", forward), ("backward", backward)):
        if not isinstance(config, ViewConfig) and (name == "forward" or config is not None):
            hint = f" (consumer.resolve({name}_request) makes one)" if isinstance(config, ViewRequest) else ""
            raise InputTypeError(
                f"{name} must be a ViewConfig{' or None' if name == 'backward' else ''}, got "
                f"{type(config).__name__}{hint}"
            )


def check_build_inputs(
    mask_func, geometry: PlanGeometry, forward: ViewConfig, backward: ViewConfig | None
) -> None:
    """What every planner (the reference one, a GPU one) checks before building: ``mask_func`` is
    the contiguous int32 ``[Hmask, nfunc, total_q]`` tensor ``geometry`` was validated from (a
    geometry of another mask would plan other rows, heads or intervals than it holds), on its
    device, the views are configs (:class:`ViewConfig`) and their signatures fit the geometry
    (:func:`check_signature_fits`)."""
    if not isinstance(mask_func, torch.Tensor):
        raise InputTypeError(f"mask_func must be a torch.Tensor, got {type(mask_func).__name__}")
    check_view_configs(forward, backward)
    g = geometry
    expected = (g.mask_heads, g.nfunc, g.total_q)
    same = same_device(mask_func.device, g.device)
    if mask_func.dtype != torch.int32 or tuple(mask_func.shape) != expected or not same:
        raise InputValueError(
            f"mask_func ({mask_func.dtype} {tuple(mask_func.shape)} on {mask_func.device}) is not the "
            f"int32 [Hmask, nfunc, total_q] = {list(expected)} tensor on {g.device} that the geometry "
            "was validated from (validate_plan_inputs(mask_func, q, k, v, ...))"
        )
    if not mask_func.is_contiguous():
        raise InputValueError("mask_func must be contiguous (call .contiguous())")
    if forward.signature.topology.pack_gqa:  # in the planner's caller's terms first (mask_func)
        require_shared_mask_for_pack_gqa(g)
    for role, config in (("forward", forward), ("backward", backward)):
        if config is not None:
            check_signature_fits(role, config.signature, g)


def check_signature_fits(role: str, signature: PlanSignature, geometry: PlanGeometry) -> None:
    """What a view's signature must agree on with its role and geometry, whoever planned it (a
    planner checks it before building, :class:`~maskplan_core.plan.PlanView` when made): its
    direction is the role; the geometry's q heads are a multiple of its kv heads and its mask heads
    1 or Hq; a PackGQA view is a forward one, of one mask for every head (its work queue has one
    task per kv head), packing the geometry's q heads per kv head; a backward view holds
    ``dq_write_order`` ranks (``dq_order_format="rank_int32"``), a forward one no dQ order
    (``"none"``)."""
    topology, g = signature.topology, geometry
    if signature.direction != role:
        raise InputValueError(f"the {role} view was given a {signature.direction} signature")
    if g.num_heads_kv < 1 or g.num_heads_q % g.num_heads_kv or g.mask_heads not in (1, g.num_heads_q):
        raise InputValueError(
            f"the {role} view's geometry has Hq={g.num_heads_q}, Hkv={g.num_heads_kv}, "
            f"Hmask={g.mask_heads}: Hq must be a multiple of Hkv, and Hmask 1 or Hq"
        )
    if topology.pack_gqa:
        if role != "forward":
            raise InputValueError(
                f"the {role} view's topology has pack_gqa=True: PackGQA is a forward view's (a K-major "
                "backward owns one kv head's K block and visits all its q heads either way)"
            )
        if g.mask_heads != 1:  # a consumer's resolve refuses pack_gqa=True for such a mask first
            raise InputValueError(
                f"the {role} view's topology has pack_gqa=True over Hmask={g.mask_heads}: PackGQA's "
                "q heads of a kv head share one tile, so it needs one mask for every head (Hmask=1)"
            )
        # a kernel sizes its packed tile by the signature: another group would leave q heads unwritten
        if topology.qhead_per_kvhead != g.qhead_per_kvhead:
            raise InputValueError(
                f"the PackGQA forward view's topology.qhead_per_kvhead={topology.qhead_per_kvhead} is not "
                f"the geometry's num_heads_q / num_heads_kv = {g.qhead_per_kvhead}"
            )
    dq_order, what = {
        "forward": ("none", "it holds no dQ order"),
        "backward": ("rank_int32", "its dq_write_order holds int32 ranks"),
    }[role]
    if signature.dq_order_format != dq_order:
        raise InputValueError(
            f"the {role} view's signature has dq_order_format={signature.dq_order_format!r}; a {role} "
            f"view's is {dq_order!r} ({what})"
        )


def cuda_index(device: torch.device) -> int:
    """The ordinal of a CUDA device (``torch.device("cuda")`` names the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device (``cuda`` and ``cuda:0`` may)."""
    return a.type == b.type and (a.type != "cuda" or cuda_index(a) == cuda_index(b))


def thd_shapes(g: PlanGeometry) -> dict[str, tuple[int, ...]]:
    """The THD shapes of an attention call's tensors for a plan of geometry ``g``: ``q, k, v, out,
    dout`` (``[total, H, D]``) and the statistics ``lse, dlse`` (``[Hq, total_q]``)."""
    o = (g.total_q, g.num_heads_q, g.head_dim_v)
    return {
        "q": (g.total_q, g.num_heads_q, g.head_dim_qk),
        "k": (g.total_k, g.num_heads_kv, g.head_dim_qk),
        "v": (g.total_k, g.num_heads_kv, g.head_dim_v),
        "out": o,
        "dout": o,
        "lse": (g.num_heads_q, g.total_q),
        "dlse": (g.num_heads_q, g.total_q),
    }


def check_thd_inputs(view: PlanView, **tensors: torch.Tensor | None) -> None:
    """Raise :class:`InputValueError` unless every given tensor (None is skipped) has the THD shape
    :func:`thd_shapes` gives for ``view``'s geometry, on the plan's device: what a consumer's
    ``forward`` / ``backward`` receive from the facade, checked where they are called directly
    (the reference attention runs it). Dtypes are the caller's to check: the reference computes in
    its own."""
    g, shapes = view.geometry, thd_shapes(view.geometry)
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != shapes[name] or not same_device(x.device, g.device):
            raise InputValueError(
                f"{name} is {tuple(x.shape)} on {x.device}; the plan's {view.role} view takes THD "
                f"{shapes[name]} on {g.device} ({g.describe()})"
            )


# -- view -> kernel config (the check every kernel launcher runs first) ----------------------------
def view_problem(view: PlanView, kernel: str) -> dict:
    """The selector arguments (``head_dim_qk, head_dim_v, dtype, qhead_per_kvhead, varlen``) of the
    problem ``view`` was planned for; raises :class:`InputValueError` naming ``kernel`` (e.g.
    "SM90 forward") unless the plan's dtype is one the kernels take."""
    g = view.geometry
    dtype = KERNEL_DTYPE_NAMES.get(g.dtype)
    if dtype is None:
        raise InputValueError(f"the {kernel} kernel takes float16/bfloat16, the plan is {g.dtype}")
    return dict(
        head_dim_qk=g.head_dim_qk,
        head_dim_v=g.head_dim_v,
        dtype=dtype,
        qhead_per_kvhead=g.qhead_per_kvhead,
        varlen=g.varlen,
    )


_Config = TypeVar("_Config", bound="ViewConfig | KernelConfig")


def require_view_signature(
    view: PlanView, direction: str, config: _Config | None, *, arch: str, note: str = ""
) -> _Config:
    """``config`` if ``view`` is a ``direction`` view carrying exactly its signature: a
    :class:`ViewConfig`'s ``signature``, or a kernel config's ``plan_signature()``.

    A view is runnable by a kernel only if re-selecting the config from the view gives the
    signature it carries; anything else is a plan for another consumer (or direction) and raises
    :class:`PlanSignatureMismatch` with the differing fields. ``config=None``: the consumer has no
    config for this view (``note`` says why, e.g. its kernel family); ``arch`` names the consumer
    ("SM90") in the message. A consumer of one's own runs it first thing in ``forward`` /
    ``backward``, with the :class:`ViewConfig` its ``resolve`` gives for the view's problem.
    """
    if config is None:
        diffs = []
    else:
        expected = config.signature if isinstance(config, ViewConfig) else config.plan_signature()
        diffs = expected.diff(view.signature)
    if config is None or view.role != direction or diffs:
        why = f"role is {view.role!r}" + (f", {note}" if note else "")
        listing = "; ".join(str(d) for d in diffs) or why
        rebuild = "create_mask_plan" + ("(..., build_backward=True)" if direction == "backward" else "")
        raise PlanSignatureMismatch(
            f"this view cannot be run by the {arch} {direction} kernel ({listing}); rebuild the plan with "
            f"{rebuild} for {arch} (flexattn), or with that consumer's build_plan and resolve "
            "(maskplan-core)",
            diffs,
        )
    return config
