"""Config selection for the SM100/SM103 kernels: problem -> :class:`Sm100FwdConfig` / :class:`Sm100BwdConfig`.

Provisional: nothing here has been measured on hardware. The defaults are the variants that have a
kernel (compiled for sm_100a, never run), so a default plan on an SM100 device can run:

* forward ``qstage1-1cta`` (``fwd_kernel.py``) for every head-dim pair with Dv <= 128, and ``d256``
  (the same kernel with O over TMEM columns 256..511 and one K/V stage) for (256, 256);
* backward ``k2q-1cta`` (``bwd_kernel.py``) for (32, 32), (64, 64), (96, 96), (128, 128) and, with its
  serial TMEM plan (dV and dK take 320 columns; S^T, P^T, dP^T and dQ share the rest), (192, 128);
  ``d256`` (the same kernel on 64-row Q blocks with the head dim of dV, dK and dQ split over two CTAs
  per K block, each recomputing S^T and dP^T: 1.4x the MMA work) for (256, 256).

The forward ``qstage1-2cta`` variant (the spec's generic one: a CTA pair, cta_group::2 MMAs, SMEM
payload ring) and ``qstage2-1cta`` (two q stages per CTA; Dqk <= 128) have kernels too
(``fwd_kernel.py``) but are selected only with ``variant=``: which is fastest is unmeasured without
hardware. The backward variant ``k2q-2cta`` (a CTA pair along K: each CTA still holds its K rows'
S^T, dP^T, dV and dK, so it saves no TMEM; the pair multicasts Q, dO, LSE and D and reduces dQ in the cluster
before one GMEM add) has a kernel (``bwd_kernel.py``) for the same head dims as ``k2q-1cta`` but is
no default either: its launcher runs a view planned for it explicitly (its ``Sm100BwdConfig``
signature and payload layout, as the tests build them through the consumer; the backward selection
takes no ``variant=``, since view_config derives the config from the view). The public API does
not reach these variants: ``create_mask_plan`` takes no variant, and ``flex_attn_func`` resolves
the default views for the call's tensors and refuses a plan of another variant with
``PlanSignatureMismatch``. ``fwd_launch.run_forward`` refuses a view of a forced
variant whose head dims have no kernel, ``bwd_launch.run_backward`` a k2q-2cta view of (256, 256), with
:class:`UnsupportedConfigError` naming the variant.

==============  =============================================  ==========================================
(Dqk, Dv)       forward default (plan block, payload)          backward default (Q x K block, payload)
==============  =============================================  ==========================================
(32, 32)        qstage1-1cta  (128x128, 1 x 128 x 4 words)     k2q-1cta  (128x128, 1 x 256 x 2 words)
(64, 64)        qstage1-1cta  (128x128, 1 x 128 x 4 words)     k2q-1cta  (128x128, 1 x 256 x 2 words)
(96, 96)        qstage1-1cta                                   k2q-1cta
(128, 128)      qstage1-1cta                                   k2q-1cta
(192, 128)      qstage1-1cta                                   k2q-1cta  (serial TMEM plan)
(256, 256)      d256          (128x128, 1 x 128 x 4 words)     d256      (64x128, 1 x 128 x 2 words,
                                                               2 CTAs per K block: head-dim halves)
==============  =============================================  ==========================================

Any generic forward variant can be forced for the D <= 192 pairs with ``variant=``. Any other pair
that one of these holds plans and runs as that one (:func:`kernel_head_dims`), on zero-padded copies
of the tensors (the consumer makes them, :mod:`maskplan_core.head_dim_padding`).
"""

from __future__ import annotations

from maskplan_core.consumer import require_supported
from maskplan_core.errors import UnsupportedConfigError
from maskplan_core.head_dim_padding import holding_head_dims

from .config import BWD_VARIANTS, FWD_VARIANTS, Sm100BwdConfig, Sm100FwdConfig

SUPPORTED_HEAD_DIMS: tuple[tuple[int, int], ...] = (
    (32, 32), (64, 64), (96, 96), (128, 128), (192, 128), (256, 256)
)  # fmt: skip
SUPPORTED_DTYPES: tuple[str, ...] = ("float16", "bfloat16")

_FWD_DEFAULT = {
    (32, 32): "qstage1-1cta",
    (64, 64): "qstage1-1cta",
    (96, 96): "qstage1-1cta",
    (128, 128): "qstage1-1cta",
    (192, 128): "qstage1-1cta",
    (256, 256): "d256",
}
_BWD_DEFAULT = {
    (32, 32): "k2q-1cta",
    (64, 64): "k2q-1cta",
    (96, 96): "k2q-1cta",
    (128, 128): "k2q-1cta",
    (192, 128): "k2q-1cta",
    (256, 256): "d256",
}
_GENERIC_FWD = ("qstage1-1cta", "qstage2-1cta", "qstage1-2cta")


def check_dtype(dtype: str) -> None:
    require_supported("dtype", dtype, SUPPORTED_DTYPES, "flexattn-sm100")


def kernel_head_dims(head_dim_qk: int, head_dim_v: int) -> tuple[int, int]:
    """The kernels' head dims that run ``(head_dim_qk, head_dim_v)``
    (:func:`maskplan_core.head_dim_padding.holding_head_dims`: ``(80, 80)`` on ``(96, 96)``,
    ``(64, 128)`` on ``(128, 128)``). The kernels read q, k, v, out and dout at their own head dims,
    so the consumer gives them zero-padded copies of other pairs' tensors."""
    return holding_head_dims(head_dim_qk, head_dim_v, SUPPORTED_HEAD_DIMS, "flexattn-sm100")


def select_fwd_config(
    *,
    head_dim_qk: int,
    head_dim_v: int,
    dtype: str,
    pack_gqa: bool = False,
    qhead_per_kvhead: int = 1,
    varlen: bool = False,
    variant: str | None = None,
) -> Sm100FwdConfig:
    """The forward config of a problem, at its kernel's head dims (:func:`kernel_head_dims`: a pair
    without a kernel of its own gets the one that holds it, whose tensors are padded copies)."""
    check_dtype(dtype)
    kernel = kernel_head_dims(head_dim_qk, head_dim_v)
    default = _FWD_DEFAULT[kernel]
    if variant is not None and variant != default:
        allowed = _GENERIC_FWD if default != "d256" else ("d256",)
        if variant not in allowed:
            on = "" if kernel == (head_dim_qk, head_dim_v) else f" (on the {kernel} kernels)"
            raise UnsupportedConfigError(
                f"variant={variant!r} cannot run (head_dim_qk, head_dim_v)=({head_dim_qk}, {head_dim_v})"
                f"{on}; supported variant values for it: {', '.join(repr(a) for a in allowed)}"
            )
    return Sm100FwdConfig(
        head_dim_qk=kernel[0],
        head_dim_v=kernel[1],
        dtype=dtype,
        variant=FWD_VARIANTS[variant or default],
        pack_gqa=pack_gqa,
        qhead_per_kvhead=qhead_per_kvhead,
        varlen=varlen,
    )


def select_bwd_config(
    *, head_dim_qk: int, head_dim_v: int, dtype: str, qhead_per_kvhead: int = 1, varlen: bool = False
) -> Sm100BwdConfig:
    """The backward config of a problem, at its kernel's head dims (as :func:`select_fwd_config`)."""
    check_dtype(dtype)
    head_dim_qk, head_dim_v = kernel_head_dims(head_dim_qk, head_dim_v)
    return Sm100BwdConfig(
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        dtype=dtype,
        variant=BWD_VARIANTS[_BWD_DEFAULT[(head_dim_qk, head_dim_v)]],
        qhead_per_kvhead=qhead_per_kvhead,
        varlen=varlen,
    )
