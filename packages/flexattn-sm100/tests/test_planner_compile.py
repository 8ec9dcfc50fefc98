"""The GPU planner's stages compile for sm_100a at every SM100 view's shapes (no GPU needed).

On a compute-capability 10.x GPU the consumer's plans are built by these kernels
(``Sm100Consumer.build_plan``); their device results for these views are checked against the
reference planner on an H200 (maskplan-kernels ``test_builder_gpu.py::test_sm100_consumer_views``).
The sm100 session sets ``CUTE_DSL_ARCH=sm_100a``.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")  # also when this file is run on its own

import torch  # noqa: E402

from flexattn_sm100 import BWD_VARIANTS, FWD_VARIANTS, Sm100BwdConfig, Sm100FwdConfig  # noqa: E402
from maskplan_core.consumer import ViewConfig  # noqa: E402

#: (forward variant, backward variant, head dims): every payload shape the consumer plans with
VIEWS = [
    ("qstage1-1cta", "k2q-1cta", (128, 128)),
    ("qstage2-1cta", "k2q-2cta", (64, 64)),
    ("qstage1-2cta", "k2q-2cta", (128, 128)),
    ("d256", "d256", (256, 256)),
]


def views(fwd_variant: str, bwd_variant: str, dims: tuple[int, int]) -> tuple[ViewConfig, ViewConfig]:
    problem = dict(head_dim_qk=dims[0], head_dim_v=dims[1], dtype="bfloat16")
    fwd = Sm100FwdConfig(variant=FWD_VARIANTS[fwd_variant], **problem)
    bwd = Sm100BwdConfig(variant=BWD_VARIANTS[bwd_variant], **problem)
    return tuple(ViewConfig(c.plan_signature(), c.payload_layout) for c in (fwd, bwd))


@pytest.mark.parametrize("variants", VIEWS, ids=lambda v: f"{v[0]}+{v[1]}")
def test_planner_stages_compile_for_the_views(variants):
    from maskplan_kernels.builder import BuildProgram

    assert os.environ["CUTE_DSL_ARCH"].startswith("sm_10")
    cuda_was_initialized = torch.cuda.is_initialized()
    fwd, bwd = views(*variants)
    program = BuildProgram.compile(fwd, bwd, 3, torch.device("cpu"))
    stages = ("geometry", "classify_fwd", "classify_bwd", "k2q_count", "scan_header", "materialize_q2k",
              "schedule_stats", "materialize_k2q")  # fmt: skip
    assert all(getattr(program, name) is not None for name in stages)
    if not cuda_was_initialized:
        assert not torch.cuda.is_initialized()  # compiling neither allocates nor synchronises
