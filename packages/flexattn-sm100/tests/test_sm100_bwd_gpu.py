"""GPU tests of the SM100 backward (k2q-1cta, d256 for (256, 256), and the k2q-2cta pair) against the fp32
reference on the same plan, mirroring ``flexattn-sm90/tests/test_bwd_gpu.py``.

They run ONLY on a compute-capability 10.x GPU. None was available when the kernel was written: these
tests have never run, and the kernel has only been compiled (``test_sm100_bwd_compile.py``).

Plans carry the SM100 forward view the forward kernel implements (qstage1 + 1CTA; d256 for (256, 256))
and the k2q-1cta backward view (d256 for (256, 256); k2q-2cta in the tests of that section; named
explicitly: the views under test do not depend on the heuristics' defaults);
the reference planner builds them on CUDA tensors. O and LSE come from the fp32 reference forward (O
rounded to the input dtype), so only the backward is under test. Outputs are NaN-poisoned, and the
caching allocator is handed a NaN block so the workspace starts as NaN. Tolerance per gradient:
relative L2 <= 2e-2 (bf16) / 5e-3 (fp16), max abs <= 4e-2 / 1e-2 times the reference's max; queries
without a visible key and keys no query sees get exactly 0 (the shared check,
:func:`maskplan_core.testing.check_backward`; the cases shared with the SM90 suite are
:class:`maskplan_core.testing.BackwardCases`). Needs the backward preprocess in ``maskplan_kernels``
(see ``bwd_launch``).

    python -m pytest packages/flexattn-sm100/tests/test_sm100_bwd_gpu.py -m gpu -q
"""

import dataclasses
import functools

import pytest
import torch

pytestmark = pytest.mark.gpu

from maskplan_core import testing  # noqa: E402

if testing.cuda_arch_major() != 10:
    pytest.skip("needs a compute-capability 10.x (SM100/SM103) GPU", allow_module_level=True)

from flexattn_sm100 import Sm100Consumer  # noqa: E402
from flexattn_sm100.bwd_launch import COMPILER, run_backward  # noqa: E402
from flexattn_sm100.config import BWD_VARIANTS, Sm100BwdConfig  # noqa: E402
from flexattn_sm100.heuristics import select_fwd_config  # noqa: E402
from maskplan_core.consumer import KERNEL_DTYPE_NAMES, ViewConfig  # noqa: E402
from maskplan_core.testing import STRIDED_CASES, BackwardCases, check_backward, reference_plan  # noqa: E402

DEV = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16]


def views(g, bwd_variant=None):
    dims = {"head_dim_qk": g.head_dim_qk, "head_dim_v": g.head_dim_v, "dtype": KERNEL_DTYPE_NAMES[g.dtype],
            "qhead_per_kvhead": g.num_heads_q // g.num_heads_kv, "varlen": g.varlen}  # fmt: skip
    d256 = (g.head_dim_qk, g.head_dim_v) == (256, 256)
    fwd = select_fwd_config(variant="d256" if d256 else "qstage1-1cta", **dims)
    bwd = Sm100BwdConfig(variant=BWD_VARIANTS[bwd_variant or ("d256" if d256 else "k2q-1cta")], **dims)
    return (ViewConfig(signature=c.plan_signature(), layout=c.payload_layout) for c in (fwd, bwd))


def sm100_plan(mask_func, q, k, v, bwd_variant=None, **varlen):
    f = lambda g: list(views(g, bwd_variant))[0]  # noqa: E731
    b = lambda g: list(views(g, bwd_variant))[1]  # noqa: E731
    return reference_plan(mask_func, q, k, v, consumer=Sm100Consumer.name, forward=f, backward=b, **varlen)


def check(mask_func, q, k, v, *, varlen=None, bwd_variant=None, **options):
    """The plan for the problem (its backward view for ``bwd_variant``, by default k2q-1cta / d256),
    then :func:`maskplan_core.testing.check_backward` with ``options``; returns ``(plan, runs)``."""
    plan = sm100_plan(mask_func, q, k, v, bwd_variant, **(varlen or {}))
    return plan, check_backward(run_backward, plan, q, k, v, **options)


#: the cases shared with the SM90 suite (maskplan_core.testing), on this consumer's check
CASES = BackwardCases(check, run_backward, DEV)
#: the same cases on k2q-2cta backward views (a cluster of two CTAs per 256-row K block)
PAIR = BackwardCases(functools.partial(check, bwd_variant="k2q-2cta"), run_backward, DEV)
#: the generic variants every shared case runs on
GENERIC = {"k2q-1cta": CASES, "k2q-2cta": PAIR}
generic = pytest.mark.parametrize("variant", sorted(GENERIC))


@generic
@pytest.mark.parametrize("d", [32, 64, 128], ids=["d32", "d64", "d128"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_causal(variant, dtype, d, deterministic):
    GENERIC[variant].causal(dtype, deterministic, d)


@generic
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_random_multi_interval_per_head(variant, dtype):
    GENERIC[variant].random_multi_interval_per_head(dtype)


@generic
def test_all_empty_rows_and_nothing_visible(variant):
    GENERIC[variant].all_empty_rows(q_block=128)  # the generic backward's Q block


def test_all_full():
    CASES.all_full()


@generic
@pytest.mark.parametrize("sq,sk", [(300, 1000), (1000, 300), (129, 127)])
def test_sq_ne_sk(variant, sq, sk):
    """k2q-2cta: 300 and 127 keys end in the first half of a 256-row block, so rank 1 of the last
    block owns no valid key (it stores no dK / dV row and adds nothing to dQ)."""
    GENERIC[variant].sq_ne_sk(sq, sk)


@generic
@pytest.mark.parametrize("hq,hkv,hmask", [(8, 2, 1), (8, 2, 8), (6, 1, 1)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gqa(variant, hq, hkv, hmask, deterministic):
    GENERIC[variant].gqa(hq, hkv, hmask, deterministic)


@pytest.mark.parametrize(
    "variant,dqk,dv",
    [("k2q-1cta", 64, 64), ("k2q-1cta", 128, 128), ("k2q-1cta", 192, 128), ("k2q-1cta", 256, 256),
     ("k2q-2cta", 128, 128)],
    ids=["d64", "d128", "d192x128", "d256-variant", "pair-d128"],
)  # fmt: skip
def test_kv_head_split(variant, dqk, dv):
    """Each kv head's q heads split over 1, 2 and 8 items on the single-CTA kernels (k2q-1cta, d256;
    the pair is never given a split, so forcing one leaves it as it is):
    :meth:`maskplan_core.testing.BackwardCases.kv_head_splits`."""
    forced = {
        s: dataclasses.replace(COMPILER, kv_head_split=lambda *_, s=s: s).run_backward for s in (1, 2, 8)
    }
    GENERIC[variant].kv_head_splits(dqk, dv, forced)


@generic
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dlse_and_scale(variant, dtype):
    GENERIC[variant].dlse_and_scale(dtype)


@generic
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_varlen_with_empty_samples(variant, kind):
    GENERIC[variant].varlen_with_empty_samples(kind)


def test_head_dim_96():
    CASES.head_dims(96, 96, "random")


@pytest.mark.parametrize("kind", ["causal", "random"])
def test_head_dims_192_128_serial_tmem_plan(kind):
    CASES.head_dims(192, 128, kind)


# -- d256: two CTAs per K block, each owning half of dV / dK / dQ's head-dim columns ------------------
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_head_dims_256_split(kind):
    CASES.head_dims(256, 256, kind)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_head_dims_256_fp16_dlse(deterministic):
    """Both dQ modes; deterministic: the halves of a writer take turns on the Q block's turnstile."""
    CASES.head_dims(256, 256, "random", torch.float16, deterministic=deterministic, with_dlse=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_head_dims_256_gqa_per_head_masks(deterministic):
    CASES.gqa(8, 2, 8, deterministic=deterministic, dims=(256, 256))


@pytest.mark.parametrize("kind", ["causal", "random"])
def test_head_dims_256_varlen_with_empty_samples(kind):
    CASES.varlen_with_empty_samples(kind, dims=(256, 256))


@pytest.mark.parametrize("layout,varlen", STRIDED_CASES.values(), ids=list(STRIDED_CASES))
def test_strided_inputs(layout, varlen):
    """q, k, v as slices of a packed QKV tensor or transposed BHSD tensors, read in place."""
    CASES.strided_inputs(layout, varlen)


def test_head_dims_256_small_for_sanitizer():
    CASES.small_for_sanitizer((256, 256))


@generic
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_deterministic_bit_identical(variant, dtype):
    """k2q-2cta: one dQ writer per pair, in dq_write_order."""
    GENERIC[variant].deterministic_bit_identical(dtype)


@generic
def test_small_for_sanitizer(variant):
    """A small case for ``compute-sanitizer --tool memcheck|racecheck|synccheck`` (select with -k small)."""
    GENERIC[variant].small_for_sanitizer()


# -- k2q-2cta: a cluster of two CTAs per 256-row K block (multicast Q / dO, dQ reduced in the pair) ----
@pytest.mark.parametrize("dims", [(32, 32), (96, 96), (192, 128)], ids=["d32", "d96", "d192x128"])
def test_pair_head_dims(dims):
    PAIR.head_dims(*dims, "random")
