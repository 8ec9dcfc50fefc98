"""``FlexAttentionFwd`` / ``FlexAttentionBwd``: ``cudnn.flex_attention``'s explicit API, where the
caller allocates every output and the object is built once from sample tensors::

    fwd = FlexAttentionFwd(q, k, v, o, plan, lse)      # sample tensors: shapes, dtypes, devices
    fwd.check_support()                                 # raises, naming what does not fit
    fwd.compile()
    fwd.execute(q, k, v, o, plan, lse)                  # writes o (and lse) in place

``execute`` takes tensors of the samples' shapes, dtypes, strides and devices and a plan of the
sample plan's consumer and geometry (a new plan per batch is fine), and runs the same consumer
``flex_attn_func`` runs. ``o`` / ``dq`` / ``dk`` / ``dv`` need a unit last stride, as cuDNN's;
contiguous, 16-byte aligned ones are written by the kernels themselves, others (e.g. slices of one
packed ``dqkv`` buffer) take the kernels' result through a copy, as a fixed-length LSE does
(``[B, Hq, Sq]`` is not the kernels' ``[Hq, total_q]`` order). Each output holds elements of its own:
none twice, none another output's or an input's, and none of an autograd graph (:func:`_require_apart`).
Inputs (q / k / v, and o / do / lse / dlse of the backward) may have any strides, as
``flex_attn_func``'s, but q / k / v need a contiguous head dim (refused otherwise); the kernels
read q / k / v in place where their base, row and head strides are 16-byte multiples (slices of
one packed QKV tensor; on Hopper also ``[B, H, S, D]`` tensors transposed, per sample, where S is
a multiple of the kernels' granule), and a copy otherwise. With ``current_stream`` the work runs
on that stream and every tensor it reads or writes, the plan's included, is recorded on it
(freeing them right after ``execute`` is safe); like any CUDA stream, it must be ordered after the
work that made them (``s.wait_stream(torch.cuda.current_stream())`` where they were made on the
current stream). No autograd: this is the inference / hand-written training-loop API.

What differs from cuDNN: flexattn's kernels take their workspace (scheduler counter, dQ
accumulator) from PyTorch's caching allocator, so ``workspace_size`` is 0: ``execute`` takes
``workspace=None`` or cuDNN-style code's ``workspace_size``-byte tensor, which it does not use;
``compile()`` checks and resolves, and the kernels are compiled (or loaded from the disk cache) by
the first ``execute``; ``sm90_use_smem_mask_pipeline`` defaults to None, the SM90 consumer's own
choice (SMEM staging unless at least half of the blocks are partial), and True / False force
cuDNN's two delivery paths (other consumers have no choice to make and ignore it).
"""

from __future__ import annotations

import functools
import inspect

import torch

from maskplan_core import (
    InputTypeError,
    InputValueError,
    MaskPlan,
    MissingBackwardViewError,
    UnsupportedCallError,
)
from maskplan_core.consumer import on_device, thd
from maskplan_core.validation import require_tensor

from . import ops
from .attention import caller_lse, check_scale, require_plan, resolve_scale
from .buffers import overlaps_itself, shared_pair
from .ops import qkv_operand


def _descriptor(t: torch.Tensor | None):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device)


def _require_is_tensor(name: str, t, *, optional: bool = False) -> None:
    """``t`` must be a torch.Tensor (or, ``optional``, None)."""
    if not (optional and t is None):
        require_tensor(name, t)


def _require_like(name: str, t: torch.Tensor | None, sample) -> None:
    """``t`` must match the sample's shape, stride, dtype and device (or both be absent)."""
    if (t is None) != (sample is None):
        state = "was" if sample is not None else "was not"
        raise InputValueError(f"{name}: a sample {state} given at construction; execute must match it")
    if t is None:
        return
    _require_is_tensor(name, t)
    got = _descriptor(t)
    if got != sample:
        fields = ("shape", "stride", "dtype", "device")
        diffs = [f"{f} {g} (sample: {s})" for f, g, s in zip(fields, got, sample, strict=True) if g != s]
        raise InputValueError(f"{name} does not match its sample: " + "; ".join(diffs))


def _require_tensor(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device) -> None:
    _require_is_tensor(name, t)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise InputValueError(
            f"{name} must be {dtype} of shape {tuple(shape)} on {device}, got {t.dtype} of shape "
            f"{tuple(t.shape)} on {t.device}"
        )


def _require_output(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device) -> None:
    """An output buffer: of the shape, dtype and device, with a unit last stride (cuDNN's rule)."""
    _require_tensor(name, t, shape, dtype, device)
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise InputValueError(f"{name} must have a unit last stride, got strides {t.stride()}")


def _require_apart(tensors: dict, outputs: tuple[str, ...]) -> None:
    """Each of ``outputs`` (names in ``tensors``) holds elements of its own: none twice (an expanded
    tensor), none of another output's or an input's, which a result would overwrite (or the kernels
    still read); and it is no node of an autograd graph, which ``execute`` would write around."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in given:
        if name not in outputs:
            continue
        if overlaps_itself(t):
            raise InputValueError(
                f"{name} names some elements more than once (shape {tuple(t.shape)}, strides {t.stride()}: "
                "an expanded tensor?); give it a buffer of its own"
            )
        if t.requires_grad and not t.is_leaf:
            raise InputValueError(
                f"{name} is a result of autograd (requires grad, not a leaf), which execute would write "
                "without autograd; give it a buffer of its own (torch.empty_like)"
            )
    pair = shared_pair(dict(given), outputs)
    if pair is not None:
        raise InputValueError(f"{pair[0]} shares memory with {pair[1]}; give each output a buffer of its own")


def _in_place(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` if the kernels can write it directly (contiguous, 16-byte aligned), else None (copy)."""
    if t is None or not t.is_contiguous() or t.data_ptr() % 16:
        return None
    return t


def _write(buffer: torch.Tensor, result: torch.Tensor) -> None:
    """The kernels' THD ``result`` into the caller's ``buffer`` unless they wrote it themselves."""
    if result.data_ptr() != buffer.data_ptr():
        buffer.copy_(result.view(buffer.shape))


def _stream(current_stream, tensors, device: torch.device):
    """The context that runs ``execute`` on ``device`` and ``current_stream`` (a ``torch.cuda.Stream``
    or a raw ``CUstream`` handle; 0, 1 and 2 name the default streams; None: the device's current
    stream), the caller's tensors recorded on it
    so that freeing them right after ``execute`` is safe (the consumers record the plan's, once
    per stream: ``maskplan_kernels.consumer_launch.cached_view_args``)."""
    if current_stream is None:
        return on_device(device)  # torch.cuda.stream below switches the device too
    if device.type != "cuda":
        raise InputValueError(f"current_stream is for CUDA tensors; these are on {device}")
    if not isinstance(current_stream, torch.cuda.Stream):
        handle = int(current_stream)
        if handle in (0, 1, 2):
            current_stream = torch.cuda.default_stream(device)
        else:
            current_stream = torch.cuda.ExternalStream(handle, device)
    if current_stream.device != device:
        raise InputValueError(f"current_stream is on {current_stream.device} but the tensors are on {device}")
    for t in tensors:
        if t is not None:
            t.record_stream(current_stream)
    return torch.cuda.stream(current_stream)


@functools.cache
def _takes_payload_hint(consumer_type: type) -> bool:
    return "payload_via_smem" in inspect.signature(consumer_type.forward).parameters


def _payload_hint(consumer_type: type, payload_via_smem: bool | None) -> dict:
    """``payload_via_smem`` for a consumer's ``forward`` where it is set and the consumer takes it
    (a plugin written before the keyword existed has no delivery choice to make)."""
    if payload_via_smem is None or not _takes_payload_hint(consumer_type):
        return {}
    return {"payload_via_smem": payload_via_smem}


class _Explicit:
    """What both directions share: the sample descriptors, the plan checks, the call stages."""

    workspace_size = 0
    training = False
    #: the tensors execute writes (the caller's buffers)
    outputs: tuple[str, ...] = ("o", "lse", "max_logit")
    #: the samples a caller may leave out (None)
    optional: tuple[str, ...] = ("lse", "max_logit")

    def __init__(self, samples: dict, mask_plan: MaskPlan) -> None:
        for name, t in samples.items():
            _require_is_tensor(f"sample_{name}", t, optional=name in self.optional)
        self._samples = {name: _descriptor(t) for name, t in samples.items()}
        self._tensors = samples  # until check_support has run
        self._plan = mask_plan
        self._consumer = None

    def _check_plan(self, mask_plan, q, k, v) -> None:
        require_plan(mask_plan, q)
        mask_plan.check_binding(q, k, v)
        if self.training and not mask_plan.has_backward:
            raise MissingBackwardViewError(
                "FlexAttentionBwd needs a plan with a backward view; rebuild it with "
                "create_mask_plan(..., build_backward=True)"
            )

    def check_support(self) -> bool:
        """Check the samples against each other and the plan, and resolve the consumer of their
        device (its signature check included); raises naming what does not fit, else True."""
        if self._consumer is None:
            t = self._tensors
            self._check_plan(self._plan, t["q"], t["k"], t["v"])
            self._check_outputs(self._plan, t)
            _require_apart(t, self.outputs)
            self._consumer = ops.checked_consumer(self._plan, t["q"].device, self.training)
            self._tensors = self._plan = None  # the samples are not kept alive
        return True

    def compile(self) -> None:
        """:meth:`check_support`; the kernels are compiled (or loaded from the disk cache) by the first
        :meth:`execute`."""
        self.check_support()

    def __call__(self, *args, **kwargs) -> None:
        """:meth:`compile` if not done yet, then ``execute(*args, **kwargs)`` (as cuDNN's)."""
        if self._consumer is None:
            self.compile()
        self.execute(*args, **kwargs)

    def _prepare(self, tensors: dict, mask_plan: MaskPlan, workspace, softmax_scale, max_logit_arg=None):
        """``(consumer, geometry, scale)`` of an ``execute`` call, its tensors checked against the
        samples and ``mask_plan`` (``max_logit_arg``: as :func:`flexattn.attention.check_scale`)."""
        if self._consumer is None:
            raise UnsupportedCallError(f"{type(self).__name__}: call compile() before execute()")
        for name, t in tensors.items():
            _require_like(name, t, self._samples[name])
        _require_apart(tensors, self.outputs)
        self._check_plan(mask_plan, tensors["q"], tensors["k"], tensors["v"])
        if workspace is not None and not isinstance(workspace, torch.Tensor):
            raise InputTypeError(
                f"workspace must be None or a torch.Tensor (of workspace_size = 0 bytes or more: "
                f"flexattn's kernels take theirs from PyTorch's caching allocator), got "
                f"{type(workspace).__name__}"
            )
        check_scale(softmax_scale, max_logit_arg)
        g = mask_plan.geometry
        consumer = ops.checked_consumer(mask_plan, tensors["q"].device, self.training)
        return consumer, g, resolve_scale(softmax_scale, g)


def _lse_shape(g) -> tuple:
    return (g.num_heads_q, g.total_q) if g.varlen else (g.batch, g.num_heads_q, g.max_seqlen_q)


def _kernel_lse(lse: torch.Tensor, g) -> torch.Tensor:
    """A caller's LSE (or dLSE) in the kernels' contiguous ``[Hq, total_q]`` order (a copy for fixed
    length): the inverse of :func:`flexattn.attention.caller_lse`."""
    return lse.contiguous() if g.varlen else lse.transpose(0, 1).reshape(g.num_heads_q, g.total_q)


class FlexAttentionFwd(_Explicit):
    """Forward into caller-allocated ``o`` (``[B, Sq, Hq, Dv]`` / ``[total_q, Hq, Dv]``, q's dtype),
    optionally ``lse`` (fp32 ``[B, Hq, Sq]`` / ``[Hq, total_q]``) and ``max_logit`` (fp32 ``[Hq]``);
    fp64 statistics for fp64 inputs on the CPU reference, as ``flex_attn_func`` returns them."""

    def __init__(
        self,
        sample_q: torch.Tensor,
        sample_k: torch.Tensor,
        sample_v: torch.Tensor,
        sample_o: torch.Tensor,
        sample_mask_plan: MaskPlan,
        sample_lse: torch.Tensor | None = None,
        *,
        sm90_use_smem_mask_pipeline: bool | None = None,
        sample_max_logit: torch.Tensor | None = None,
    ) -> None:
        if sm90_use_smem_mask_pipeline is not None and type(sm90_use_smem_mask_pipeline) is not bool:
            raise InputTypeError(
                "sm90_use_smem_mask_pipeline must be True, False or None, got "
                f"{type(sm90_use_smem_mask_pipeline).__name__}"
            )
        self.payload_via_smem = sm90_use_smem_mask_pipeline
        samples = dict(
            q=sample_q, k=sample_k, v=sample_v, o=sample_o, lse=sample_lse, max_logit=sample_max_logit
        )
        super().__init__(samples, sample_mask_plan)

    def _check_outputs(self, plan: MaskPlan, t: dict) -> None:
        g, q = plan.geometry, t["q"]
        _require_output("o", t["o"], (*q.shape[:-1], g.head_dim_v), q.dtype, q.device)
        stat = ops.stat_dtype(q.dtype)
        if t["lse"] is not None:  # written in place where it can be, else copied
            _require_tensor("lse", t["lse"], _lse_shape(g), stat, q.device)
        if t["max_logit"] is not None:
            _require_tensor("max_logit", t["max_logit"], (g.num_heads_q,), stat, q.device)

    def execute(
        self,
        q_tensor: torch.Tensor,
        k_tensor: torch.Tensor,
        v_tensor: torch.Tensor,
        o_tensor: torch.Tensor,
        mask_plan: MaskPlan,
        lse_tensor: torch.Tensor | None = None,
        *,
        workspace: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        current_stream=None,
        max_logit_tensor: torch.Tensor | None = None,
    ) -> None:
        """Attention of ``q_tensor`` / ``k_tensor`` / ``v_tensor`` with ``mask_plan``, written into
        ``o_tensor`` and, where given, ``lse_tensor`` and ``max_logit_tensor`` (the layouts of the
        class docstring; each shaped as its ``sample_*`` was, ``max_logit_tensor`` only where
        ``sample_max_logit`` was given). ``softmax_scale`` None is ``1 / sqrt(head_dim_qk)``;
        ``current_stream`` (a ``torch.cuda.Stream`` or a raw ``CUstream`` handle) is where the work
        is queued, None the device's current stream; ``workspace`` (None, or cuDNN-style code's
        tensor) is not used: ``workspace_size`` is 0 (module docstring)."""
        tensors = dict(
            q=q_tensor, k=k_tensor, v=v_tensor, o=o_tensor, lse=lse_tensor, max_logit=max_logit_tensor
        )
        max_logit_arg = None if max_logit_tensor is None else "max_logit_tensor"
        consumer, g, scale = self._prepare(tensors, mask_plan, workspace, softmax_scale, max_logit_arg)
        in_place_lse = _in_place(lse_tensor) if g.varlen else None
        in_place_o = _in_place(o_tensor)
        with _stream(current_stream, tensors.values(), q_tensor.device), torch.no_grad():
            res = consumer.forward(
                mask_plan, *map(qkv_operand, (q_tensor, k_tensor, v_tensor)), softmax_scale=scale,
                return_max_logit=max_logit_tensor is not None,
                out=None if in_place_o is None else thd(in_place_o), lse=in_place_lse,
                **_payload_hint(type(consumer), self.payload_via_smem),
            )  # fmt: skip
            _write(o_tensor, res.out)
            if lse_tensor is not None and in_place_lse is None:
                lse_tensor.copy_(caller_lse(res.lse, q_tensor))
            if max_logit_tensor is not None:
                max_logit_tensor.copy_(res.max_logit)


class FlexAttentionBwd(_Explicit):
    """Backward into caller-allocated ``dq`` / ``dk`` / ``dv`` (shaped and typed like q / k / v), from
    the forward's ``o`` and ``lse`` (fp32; fp64 for fp64 inputs) and optionally an LSE gradient ``dlse``
    of the LSE's shape."""

    training = True
    outputs = ("dq", "dk", "dv")
    optional = ("dlse",)

    def __init__(
        self,
        sample_q: torch.Tensor,
        sample_k: torch.Tensor,
        sample_v: torch.Tensor,
        sample_o: torch.Tensor,
        sample_do: torch.Tensor,
        sample_lse: torch.Tensor,
        sample_dq: torch.Tensor,
        sample_dk: torch.Tensor,
        sample_dv: torch.Tensor,
        sample_mask_plan: MaskPlan,
        sample_dlse: torch.Tensor | None = None,
        *,
        deterministic: bool = False,
    ) -> None:
        if type(deterministic) is not bool:
            raise InputTypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
        self.deterministic = deterministic
        samples = dict(
            q=sample_q, k=sample_k, v=sample_v, o=sample_o, do=sample_do, lse=sample_lse,
            dq=sample_dq, dk=sample_dk, dv=sample_dv, dlse=sample_dlse,
        )  # fmt: skip
        super().__init__(samples, sample_mask_plan)

    def _check_outputs(self, plan: MaskPlan, t: dict) -> None:
        g, q = plan.geometry, t["q"]
        out_shape = (*q.shape[:-1], g.head_dim_v)
        for name in ("o", "do"):  # inputs: any strides
            _require_tensor(name, t[name], out_shape, q.dtype, q.device)
        for name in ("lse", "dlse"):
            if t[name] is not None or name == "lse":
                _require_tensor(name, t[name], _lse_shape(g), ops.stat_dtype(q.dtype), q.device)
        for name, like in (("dq", q), ("dk", t["k"]), ("dv", t["v"])):
            _require_output(name, t[name], like.shape, like.dtype, like.device)

    def execute(
        self,
        q_tensor: torch.Tensor,
        k_tensor: torch.Tensor,
        v_tensor: torch.Tensor,
        o_tensor: torch.Tensor,
        do_tensor: torch.Tensor,
        lse_tensor: torch.Tensor,
        dq_tensor: torch.Tensor,
        dk_tensor: torch.Tensor,
        dv_tensor: torch.Tensor,
        mask_plan: MaskPlan,
        dlse_tensor: torch.Tensor | None = None,
        *,
        workspace: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        current_stream=None,
    ) -> None:
        """Gradients of attention with ``mask_plan`` (built with ``build_backward=True``) written into
        ``dq_tensor`` / ``dk_tensor`` / ``dv_tensor``, from the forward's ``o_tensor`` and
        ``lse_tensor``, the output gradient ``do_tensor`` and, where the LSE takes a gradient,
        ``dlse_tensor``; ``deterministic`` (the constructor's), or
        ``torch.use_deterministic_algorithms(True)`` in force at this call, makes dQ bit-identical
        from run to run. ``softmax_scale`` must be the forward's (None: ``1 / sqrt(head_dim_qk)``);
        ``current_stream`` and ``workspace`` as in :meth:`FlexAttentionFwd.execute`."""
        tensors = dict(
            q=q_tensor, k=k_tensor, v=v_tensor, o=o_tensor, do=do_tensor, lse=lse_tensor,
            dq=dq_tensor, dk=dk_tensor, dv=dv_tensor, dlse=dlse_tensor,
        )  # fmt: skip
        consumer, g, scale = self._prepare(tensors, mask_plan, workspace, softmax_scale)
        buffers = (dq_tensor, dk_tensor, dv_tensor)
        in_place = [None if b is None else thd(b) for b in map(_in_place, buffers)]
        with _stream(current_stream, tensors.values(), q_tensor.device), torch.no_grad():
            dlse = None if dlse_tensor is None else _kernel_lse(dlse_tensor, g)  # a copy: on the stream
            grads = consumer.backward(
                mask_plan, *map(qkv_operand, (q_tensor, k_tensor, v_tensor)), thd(o_tensor),
                _kernel_lse(lse_tensor, g), thd(do_tensor), dlse, softmax_scale=scale,
                deterministic=ops.backward_determinism(self.deterministic),
                dq=in_place[0], dk=in_place[1], dv=in_place[2],
            )  # fmt: skip
            for buffer, grad in zip(buffers, grads, strict=True):
                _write(buffer, grad)
