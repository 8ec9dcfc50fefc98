"""Host structural validation of every public input (spec sections 2, 3, 4.1).

Only structure is checked here (types, dtypes, ranks, devices, layouts, shapes, head counts).
Endpoint and prefix *values* are checked by the planner stages, which report them through the
allocation header's error word (:mod:`maskplan_core.error_flags`).
"""

from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .endpoint_samples import built_rows_hint, check_heads, check_samples, describe_lengths, recorded
from .error_flags import broken_prefix_rule, sample_lengths
from .errors import InputTypeError, InputValueError, SeqlenError, UnsupportedCallError, warn_caller
from .geometry import PlanGeometry

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
#: endpoints, sequence lengths and prefixes are int32 in the plan ABI
MAX_SEQLEN = 2**31 - 1
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: from this many heads on, more heads than positions (fixed layout) draws a BHSD warning, where k
#: (whose heads would then be its positions) has more heads than positions too
BHSD_SUSPECT_HEADS = 128


def require_tensor(name: str, value: object) -> torch.Tensor:
    """``value`` if it is a tensor flexattn can take: a torch.Tensor, not a DTensor."""
    if not isinstance(value, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported by whoever made a DTensor
    if dtensor is not None and isinstance(value, dtensor.DTensor):
        # its shape is the global one, and torch has no sharding rule for flexattn's ops
        raise InputTypeError(
            f"{name} is a DTensor (placements {tuple(value.placements)}): flexattn takes local tensors: "
            f"pass {name}.to_local() and plan for the local tensors (tensor parallelism: ColwiseParallel's "
            "default use_local_output=True gives local q, k, v; a per-head mask takes the rows of the "
            "rank's heads, mask[first_head:first_head + local_heads])"
        )
    return value


#: the call that turns a mask of another form (by :func:`mask_kind`) into endpoints
_ENDPOINTS_OF = {
    "BlockMask": "masks.from_block_mask(block_mask)",
    "function": "masks.from_mask_mod(mask_mod, B, H, Sq, Sk)",
    "a bool tensor": "masks.from_dense(mask)",
}


def mask_kind(mask: object) -> str:
    """What a mask passed somewhere is, for messages: its type name, or "a bool tensor"."""
    is_bool = isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
    return "a bool tensor" if is_bool else type(mask).__name__


def endpoints_of(mask: object) -> str | None:
    """The call that converts ``mask`` (a torch ``BlockMask``, a ``mask_mod`` -- a function or any
    other callable but a class or module, such as a ``functools.partial`` -- or a bool tensor) to
    interval endpoints, or None for any other object."""
    kind = mask_kind(mask)
    if kind not in _ENDPOINTS_OF and callable(mask) and not isinstance(mask, (type, torch.nn.Module)):
        kind = "function"
    return _ENDPOINTS_OF.get(kind)


def require_strided(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is a plain (strided) tensor (:func:`require_tensor`). A nested (jagged) batch goes
    in as its THD rows, with its offsets as the sample prefixes."""
    require_tensor(name, t)
    if t.is_nested:
        raise InputTypeError(
            f"{name} is a nested tensor: pass its rows as THD [total, H, D] ({name}.values()) with "
            f"cu_seqlens_q/k ({name}.offsets() as int32) and max_seqlen_q/k"
        )
    if t.layout != torch.strided:
        raise InputTypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    return t


def require_int(name: str, value: object, *, minimum: int = 0) -> int:
    """``value`` as a Python int: an int or another integral number (a numpy integer), not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        tensor = isinstance(value, torch.Tensor) and value.numel() == 1
        hint = f" ({name}.item() reads it back)" if tensor else ""
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__}{hint}")
    if value < minimum:
        raise InputValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def require_optional_bool(name: str, value: object) -> None:
    if value is not None and type(value) is not bool:
        raise InputTypeError(f"{name} must be a bool or None, got {type(value).__name__}")


def representable_scale(softmax_scale: float, dtype: torch.dtype, scaled_by: str) -> float:
    """``softmax_scale`` as a float that ``dtype``, the dtype ``scaled_by`` (e.g. "the GPU kernels
    compute") scales scores in, holds; else :class:`InputValueError`: a scale past its range would
    make every score infinite, the outputs NaN."""
    softmax_scale, limit = float(softmax_scale), torch.finfo(dtype).max
    if not abs(softmax_scale) <= limit:
        raise InputValueError(
            f"softmax_scale={softmax_scale!r} is past the fp{torch.finfo(dtype).bits} range ({limit:.4g}) "
            f"{scaled_by} scores in"
        )
    return softmax_scale


def autocast_region_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype of the ``torch.autocast`` region enclosing ``device``'s type, None outside one.
    Only CPU and CUDA are asked (the device types attention runs on; another may have no autocast,
    where torch raises), and without ``torch.amp.is_autocast_available``, which torch 2.11's Dynamo
    cannot trace: under ``torch.compile`` the answer is a constant of the graph, guarded."""
    if device.type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def head_dim_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t``'s last (head) dimension is contiguous; a dimension of one element always is,
    whatever stride torch gives it (a transposed ``[..., 1]`` tensor keeps the old one)."""
    return t.stride(-1) == 1 or t.size(-1) <= 1


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, dtypes) -> None:
    layout = "BSHD [B, S, H, D]" if rank == 4 else "THD [total, H, D]"
    for i, (name, t) in enumerate((("q", q), ("k", k), ("v", v))):
        require_strided(name, t)
        dtype, q_dtype = (dtypes[i], dtypes[0]) if dtypes else (t.dtype, q.dtype)
        if t.dim() != rank:
            # the layout follows from the varlen arguments: name them for a THD tensor without them
            thd = rank == 4 and t.dim() == 3
            hint = "; THD [total, H, D] tensors need cu_seqlens_q/k and max_seqlen_q/k" if thd else ""
            raise InputValueError(f"{name} must be {layout} (rank {rank}), got shape {tuple(t.shape)}{hint}")
        if not head_dim_contiguous(t):
            raise InputValueError(
                f"{name} must have a contiguous last (head) dimension, got strides {t.stride()} "
                f"({name}.contiguous() copies it)"
            )
        if t.device != q.device:
            raise InputValueError(f"{name} is on {t.device} but q is on {q.device}")
        allowed = REFERENCE_DTYPES if t.device.type == "cpu" else KERNEL_DTYPES
        if dtype not in allowed:  # each named for its own dtype, before comparing it with q's
            raise InputTypeError(
                f"{name} dtype must be one of {[str(d) for d in allowed]} on {t.device.type}, got {dtype}"
            )
        if dtype != q_dtype:
            raise InputTypeError(f"{name} has dtype {dtype} but q has {q_dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise InputValueError(
            f"k and v must agree on every dimension but the last: k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise InputValueError(f"q and k head dims differ: q {q.shape[-1]}, k {k.shape[-1]}")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise InputValueError(f"head dims must be >= 1, got q/k {q.shape[-1]}, v {v.shape[-1]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hq == 0 or hkv == 0:
        raise InputValueError(
            f"q and k/v need at least one head each (dim {rank - 2}): q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if hq % hkv:
        hint = ""
        # heads in dim 1 (torch's layout: fewer of them than positions) in q, in k, or in both,
        # where reading them so makes q's heads a multiple of k's
        bhsd = [rank == 4 and 0 < t.shape[1] < t.shape[2] for t in (q, k)]
        heads = [t.shape[1] if b else t.shape[-2] for t, b in zip((q, k), bhsd, strict=True)]
        if any(bhsd) and heads[0] % heads[1] == 0:
            # one tensor alone may as well be BSHD with fewer positions than heads (a decoding step)
            which, fix = {
                (True, True): ("q and k look like", "q.transpose(1, 2), and k, v alike"),
                (True, False): ("if q is", "q.transpose(1, 2)"),
                (False, True): ("if k and v are", "k.transpose(1, 2), v.transpose(1, 2)"),
            }[tuple(bhsd)]
            hint = f"; {which} BHSD [B, H, S, D]: flexattn takes BSHD [B, S, H, D] ({fix})"
        raise InputValueError(
            f"q heads ({hq}) must be a positive multiple of k/v heads ({hkv}): q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}{hint}"
        )
    if rank == 4 and q.shape[0] != k.shape[0]:
        raise InputValueError(f"q and k batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")


def _check_prefix(name: str, cu: object, device: torch.device) -> torch.Tensor:
    if isinstance(cu, (list, tuple)):
        raise InputTypeError(
            f"{name} must be a torch.Tensor, got {type(cu).__name__} (torch.tensor({name}, "
            "dtype=torch.int32, device=q.device))"
        )
    cu = require_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise InputTypeError(f"{name} must be int32, got {cu.dtype} ({name}.int(), as cuDNN takes it)")
    if cu.dim() != 1:
        raise InputValueError(f"{name} must be rank-1 with B+1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.numel() < 2:
        raise SeqlenError(f"{name} must be rank-1 with B+1 >= 2 entries, got shape {tuple(cu.shape)}")
    if not cu.is_contiguous():
        raise InputValueError(f"{name} must be contiguous (call .contiguous())")
    if cu.device != device:
        raise InputValueError(f"{name} is on {cu.device} but q is on {device}")
    return cu


def _require_real(*args: object) -> None:
    """Plans are built from real tensors: the planner reads the endpoints' and prefixes' values,
    which fake tensors (a FakeTensorMode: ``torch.export``, fake tracing) do not have, and a fake
    prefix kept by :func:`fixed_prefixes`' cache would break later real builds of that shape."""
    fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    if fake_mode or any(isinstance(a, FakeTensor) for a in args):
        raise UnsupportedCallError(
            "a mask plan is built from real tensors (the planner reads the endpoints), not under a "
            "FakeTensorMode or from fake tensors (torch.export, fake tracing): build the plan outside "
            "and pass it in"
        )


def write_count(t: torch.Tensor) -> int:
    """How many in-place writes ``t`` has had (its version counter); 0 for an inference tensor,
    which keeps none (made under ``torch.inference_mode``; the planner makes its prefixes outside it)."""
    return 0 if t.is_inference() else t._version


def fixed_prefixes(batch: int, max_q: int, max_k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``arange(B + 1) * S`` for Q and K: made once per shape and device and shared by every plan of
    that shape (no plan stage writes them). Every plan build of fixed-length input needs them, and
    two tensor ops per build were a tenth of a warm GPU build's host time. On a GPU the first use
    waits for them, so a build on any stream reads complete prefixes. Prefixes written in place
    through a plan's geometry (which the plans that hold them then refuse) are made anew."""
    prefixes = _shared_prefixes(batch, max_q, max_k, device)
    if any(write_count(t) for t in prefixes):
        _shared_prefixes.cache_clear()
        prefixes = _shared_prefixes(batch, max_q, max_k, device)
    return prefixes


@functools.lru_cache(maxsize=64)
def _shared_prefixes(batch: int, max_q: int, max_k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    # normal tensors, whatever mode the first build ran in, so writes into them are counted
    with torch.inference_mode(False):
        steps = torch.arange(batch + 1, dtype=torch.int32, device=device)
        cu_q, cu_k = steps * max_q, steps * max_k
    if cu_q.is_cuda:
        torch.cuda.current_stream(cu_q.device).synchronize()
    return cu_q, cu_k


def _varlen_samples(cu_q: torch.Tensor, cu_k: torch.Tensor, totals: tuple, max_lens: tuple):
    """Each varlen sample's query rows and keys, or None where the prefixes break a rule of the
    planner's prefix check (spec 3.2, ``error_flags.broken_prefix_rule``), which then names it.
    A read back (of a builder's mask only): a prefix tensor's values cannot be remembered from its
    builder, as writes torch does not count (a collective's, a numpy alias's) would go unseen."""
    lens = []
    for name, cu, total, max_len in zip(
        ("cu_seqlens_q", "cu_seqlens_k"), torch.stack((cu_q, cu_k)).tolist(), totals, max_lens, strict=True
    ):
        if broken_prefix_rule(name, cu, total, max_len) is not None:
            return None
        lens.append(sample_lengths(cu))
    return tuple(lens)


def validate_plan_inputs(
    mask_func: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
) -> PlanGeometry:
    """Check the structure of a plan's inputs (``flexattn.create_mask_plan``'s arguments, or a
    consumer's ``build_plan``'s) and derive the plan geometry. ``dtypes``: the dtypes q, k, v reach
    attention in, where not their own (flexattn's casts under ``torch.autocast``)."""
    _require_real(mask_func, q, k, v, cu_seqlens_q, cu_seqlens_k)
    varlen_args = {
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
        "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k,
    }
    given = [n for n, a in varlen_args.items() if a is not None]
    if given and len(given) != 4:
        missing = [n for n in varlen_args if n not in given]
        raise InputValueError(
            f"varlen input needs all of cu_seqlens_q/k and max_seqlen_q/k; missing {missing}"
        )
    varlen = bool(given)
    _check_qkv(require_tensor("q", q), k, v, 3 if varlen else 4, dtypes)
    device = q.device
    if varlen:
        cu_q = _check_prefix("cu_seqlens_q", cu_seqlens_q, device)
        cu_k = _check_prefix("cu_seqlens_k", cu_seqlens_k, device)
        if cu_q.shape != cu_k.shape:
            raise InputValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same shape, "
                f"got {tuple(cu_q.shape)} and {tuple(cu_k.shape)}"
            )
        max_q = require_int("max_seqlen_q", max_seqlen_q, minimum=0)
        max_k = require_int("max_seqlen_k", max_seqlen_k, minimum=0)
        for name, n in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
            if n > MAX_SEQLEN:
                raise InputValueError(f"{name} = {n} exceeds the int32 sequence range (<= {MAX_SEQLEN})")
        batch, total_q, total_k = cu_q.numel() - 1, q.shape[0], k.shape[0]
        with torch.inference_mode(False):  # normal tensors: a version counter for the plan's binding
            cu_q, cu_k = cu_q.clone(), cu_k.clone()
    else:
        batch, max_q, max_k = q.shape[0], q.shape[1], k.shape[1]
        if batch == 0:  # a sequence length of 0 is an empty problem (zeros and an LSE of -inf)
            raise InputValueError(
                f"q and k must have a nonzero batch size, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        total_q, total_k = batch * max_q, batch * max_k
        for name, t, total in (("q", q, total_q), ("k", k, total_k)):
            if total > MAX_SEQLEN:  # the int32 prefixes would wrap
                raise InputValueError(
                    f"{name} {tuple(t.shape)} holds {total} tokens (B x S); a plan's int32 token "
                    f"offsets reach {MAX_SEQLEN}"
                )
        cu_q, cu_k = fixed_prefixes(batch, max_q, max_k, device)
    if not isinstance(mask_func, torch.Tensor) or mask_func.dtype == torch.bool:
        kind, convert = mask_kind(mask_func), endpoints_of(mask_func)
        hint = f"; convert it with {convert}" if convert else ""
        raise InputTypeError(
            f"mask_func must be an int32 torch.Tensor of interval endpoints [Hmask, nfunc, total_q], got "
            f"{kind}{hint}"
        )
    require_strided("mask_func", mask_func)
    hq, hkv = q.shape[-2], k.shape[-2]
    if mask_func.dtype != torch.int32:
        if mask_func.dim() == 3 and mask_func.shape[1] % 2 == 1:  # endpoints' shape: their values cast
            fix = "; if its values are key positions, pass mask_func.int()"
        elif mask_func.dtype.is_floating_point:
            fix = "; an additive float mask (0 where visible) converts with masks.from_dense(mask == 0)"
        else:
            fix = "; a 0/1 mask (1 where visible) converts with masks.from_dense(mask.bool())"
        raise InputTypeError(f"mask_func must be int32 interval endpoints, got {mask_func.dtype}{fix}")
    if mask_func.dim() != 3:
        raise InputValueError(
            f"mask_func must be [Hmask, nfunc, total_q] (rank 3), got shape {tuple(mask_func.shape)}"
        )
    if mask_func.device != device:
        raise InputValueError(
            f"mask_func is on {mask_func.device} but q is on {device}: build it there (the mask "
            f"builders' device=q.device; they default to the CPU, torch's create_block_mask to the "
            f"current accelerator) or move it (mask_func.to(q.device))"
        )
    if not mask_func.is_contiguous():
        raise InputValueError("mask_func must be contiguous (call .contiguous())")
    hmask, nfunc, rows = mask_func.shape
    # a per-sample [B, Sq, Sk] bool mask given to masks.from_dense, which reads rank 3 as
    # [Hmask, total_q, Sk]: B heads of Sq rows
    batch_as_heads = not varlen and batch > 1 and hmask == batch and rows == max_q
    batch_as_heads_hint = (
        f"if mask_func came from a [B, Sq, Sk] bool mask, masks.from_dense read its {batch} samples as "
        "heads (rank 3 is [Hmask, total_q, Sk]): pass mask[:, None], SDPA's [B, 1, Sq, Sk]"
    )
    check_heads(mask_func, hq)  # a mask_mod's record first: its heads are q heads, never kv heads
    if hmask not in (1, hq):
        hint = f"; {batch_as_heads_hint}" if batch_as_heads else ""
        if hmask == hkv and rows == total_q and not batch_as_heads:  # one per kv head (GQA)
            hint = (
                f"; that is one per k/v head: masks are per q head (a builder's H or heads is Hq; "
                f"mask_func.repeat_interleave({hq // hmask}, dim=0) gives each q head its kv head's)"
            )
        raise InputValueError(f"mask_func has Hmask={hmask} heads; it must be 1 or Hq={hq}{hint}")
    # [Hmask, total_q, nfunc] passed as is: its rows are an odd nfunc, its nfunc the query rows
    transposed = nfunc == total_q and rows != total_q and rows % 2 == 1
    transposed_hint = (
        "; mask_func looks like [Hmask, total_q, nfunc]: its layout is [Hmask, nfunc, total_q] "
        "(mask_func.transpose(1, 2).contiguous())"
    )
    if nfunc <= 0 or nfunc % 2 == 0:
        hint = transposed_hint
        if not transposed:
            hint = (
                "; a row's endpoints F0 <= F1 <= ... give the visible keys [0, F0) U [F1, F2) U ..., an "
                "odd count (for [a, b) alone, F0 = 0: [0, a, b])"
            )
        raise InputValueError(f"mask_func nfunc (dim 1) must be a positive odd number, got {nfunc}{hint}")
    if rows != total_q:
        hint = ""
        built = built_rows_hint(mask_func)  # a builder's record names its samples and how to make q's
        bhsd_q = not varlen and rows == q.shape[0] * q.shape[2]  # torch FlexAttention's layout
        if built and not bhsd_q:
            hint = built
        elif varlen and not transposed:
            hint = "; with varlen input mask_func's rows, q.shape[0] and cu_seqlens_q[-1] must all agree"
        elif bhsd_q:
            hint = "; q looks like BHSD [B, H, S, D], flexattn takes BSHD [B, S, H, D] (q.transpose(1, 2))"
        elif not varlen and ((rows == max_q and batch > 1) or (rows == batch and max_q > 1)):
            hints = [transposed_hint[2:]] if transposed else []
            if rows == max_q:
                other_s = f"; if for {batch} samples, its S is not q's {max_q}" if max_q % batch == 0 else ""
                hints.append(
                    f"if mask_func was built for one sample of {max_q} rows, build it for the batch "
                    "(masks.causal(S, batch=B), masks.from_mask_mod(mask_mod, B, ...), "
                    f"masks.from_block_mask(..., batch=B), a dense mask expanded to B){other_s}"
                )
            if batch_as_heads:
                hints.append(batch_as_heads_hint)
            if rows == batch:
                hints.append(
                    "if mask_func came from a [B, 1, 1, Sk] key-padding mask (one query row per sample), "
                    f"expand that to every query row before masks.from_dense (mask.expand({batch}, -1, "
                    f"{max_q}, -1))"
                )
            hint = "; " + "; or, ".join(hints)
        elif transposed:
            hint = transposed_hint
        elif not varlen:  # no hint above fits: say what a builder made it for, if one did
            hint = built_rows_hint(mask_func, describe_lengths((max_q,) * batch, "rows"))
        longer = not varlen and rows % batch == 0 and rows // batch > max_q and not bhsd_q
        record = recorded(mask_func)
        if longer and (record is None or record.rows == (rows // batch,) * batch):
            hint += (
                f"{'; or,' if hint else ';'} where q holds {max_q} of the positions of each of {batch} "
                "longer samples (a context-parallel shard, a prefill chunk), take their rows of the whole "
                f"sequence's mask: masks.select_rows(mask_func, positions, batch={batch}) (a mask built "
                f"for {max_q} rows would show other keys)"
            )
        layout = "" if varlen else f" ({batch} sample{'s' * (batch != 1)} of {max_q})"
        raise InputValueError(
            f"mask_func has {rows} query rows (dim 2) but q has total_q={total_q}{layout}{hint}"
        )
    if varlen:
        lens = functools.partial(_varlen_samples, cu_q, cu_k, (total_q, total_k), (max_q, max_k))
        check_samples(mask_func, lens)
    else:
        check_samples(mask_func, lambda: ([max_q] * batch, [max_k] * batch))
    if not varlen and hq >= BHSD_SUSPECT_HEADS and hq > max(max_q, max_k) and hkv > max_k:
        warn_caller(
            f"q has {hq} heads and {max_q} positions per sample (k {max_k}): flexattn takes BSHD "
            "[B, S, H, D]; a [B, H, S, D] tensor shows up as many heads and few positions. If that is "
            "what q, k and v are, pass q.transpose(1, 2) (and k, v alike) and build the mask for S",
        )
    return PlanGeometry(
        batch=batch,
        varlen=varlen,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        total_q=total_q,
        total_k=total_k,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim_qk=q.shape[-1],
        head_dim_v=v.shape[-1],
        mask_heads=hmask,
        nfunc=nfunc,
        dtype=dtypes[0] if dtypes else q.dtype,
        device=device,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
    )
