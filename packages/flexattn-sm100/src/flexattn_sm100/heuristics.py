"""Config selection for the SM100/SM103 kernels: problem -> :class:`Sm100FwdConfig` / :class:`Sm100BwdConfig`.

Provisional: nothing here has been measured on hardware. The table fixes a topology per head-dim
pair so plans (and their signatures) are well defined; it will be revisited when the kernels land
(a change bumps the affected kernel family / layout versions). Only the qstage1 + 1CTA forward kernel
exists (``fwd_kernel.py``, compiled for sm_100a, never run): it serves plans built with
``variant="qstage1-1cta"``, which is the default only for (192, 128); the other defaults have no
kernel yet and ``fwd_launch.run_forward`` refuses them.

==============  =============================================  ==========================================
(Dqk, Dv)       forward variant (plan block, payload)          backward variant (Q x K block, payload)
==============  =============================================  ==========================================
(64, 64)        qstage2-1cta  (256x128, 2 x 128 x 4 words)     k2q-1cta  (128x128, 1 x 256 x 2 words)
(96, 96)        qstage2-1cta                                   k2q-1cta
(128, 128)      qstage1-2cta  (256x128, 2 x 128 x 4, SMEM)     k2q-2cta  (128x256, 2 x 256 x 2, cluster n)
(192, 128)      qstage1-1cta  (128x128, 1 x 128 x 4 words)     k2q-2cta
(256, 256)      d256          (128x128, 1 x 128 x 4 words)     d256      (64x128, 1 x 128 x 2 words)
==============  =============================================  ==========================================

Any generic forward variant can be forced for the D <= 192 pairs with ``variant=``.
"""

from __future__ import annotations

from maskplan_core.consumer import require_supported
from maskplan_core.errors import UnsupportedConfigError

from .config import BWD_VARIANTS, FWD_VARIANTS, Sm100BwdConfig, Sm100FwdConfig

SUPPORTED_HEAD_DIMS: tuple[tuple[int, int], ...] = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
SUPPORTED_DTYPES: tuple[str, ...] = ("float16", "bfloat16")

_FWD_DEFAULT = {
    (64, 64): "qstage2-1cta",
    (96, 96): "qstage2-1cta",
    (128, 128): "qstage1-2cta",
    (192, 128): "qstage1-1cta",
    (256, 256): "d256",
}
_BWD_DEFAULT = {
    (64, 64): "k2q-1cta",
    (96, 96): "k2q-1cta",
    (128, 128): "k2q-2cta",
    (192, 128): "k2q-2cta",
    (256, 256): "d256",
}
_GENERIC_FWD = ("qstage1-1cta", "qstage2-1cta", "qstage1-2cta")


def check_dtype(dtype: str) -> None:
    require_supported("dtype", dtype, SUPPORTED_DTYPES, "flexattn-sm100")


def check_head_dims(head_dim_qk: int, head_dim_v: int) -> None:
    head_dims = (head_dim_qk, head_dim_v)
    require_supported("(head_dim_qk, head_dim_v)", head_dims, SUPPORTED_HEAD_DIMS, "flexattn-sm100")


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
    check_dtype(dtype)
    check_head_dims(head_dim_qk, head_dim_v)
    default = _FWD_DEFAULT[(head_dim_qk, head_dim_v)]
    if variant is not None and variant != default:
        allowed = _GENERIC_FWD if default != "d256" else ("d256",)
        if variant not in allowed:
            raise UnsupportedConfigError(
                f"variant={variant!r} cannot run (head_dim_qk, head_dim_v)=({head_dim_qk}, {head_dim_v}); "
                f"supported variant values for it: {', '.join(repr(a) for a in allowed)}"
            )
    return Sm100FwdConfig(
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        dtype=dtype,
        variant=FWD_VARIANTS[variant or default],
        pack_gqa=pack_gqa,
        qhead_per_kvhead=qhead_per_kvhead,
        varlen=varlen,
    )


def select_bwd_config(
    *, head_dim_qk: int, head_dim_v: int, dtype: str, qhead_per_kvhead: int = 1, varlen: bool = False
) -> Sm100BwdConfig:
    check_dtype(dtype)
    check_head_dims(head_dim_qk, head_dim_v)
    return Sm100BwdConfig(
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        dtype=dtype,
        variant=BWD_VARIANTS[_BWD_DEFAULT[(head_dim_qk, head_dim_v)]],
        qhead_per_kvhead=qhead_per_kvhead,
        varlen=varlen,
    )
