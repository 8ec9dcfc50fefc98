"""Architecture-neutral MaskPlan planner kernels in CuTe DSL (spec section 4).

Importing this package imports CuTe DSL (``cutlass``); ``maskplan_core`` never imports it.
Every kernel has a pure-torch twin in ``maskplan_core.reference`` and is tested bit-exactly
against it on the GPU; CI compiles every kernel for ``CUTE_DSL_ARCH=sm_90a`` without a GPU.

Stages (one kernel class per module) and the pipeline that runs them::

    geometry.VarlenGeometry          row prefixes, sequence_desc, row ownership, prefix errors
    classify.Q2KClassify             visible/full bitsets, counts, endpoint errors
    k2q_count.K2QCount               K2Q counts from the backward bitsets
    scan_header.ScanHeader           exclusive CSR offsets + the 8-value allocation header
    materialize_q2k.Q2KMaterialize   forward CSRs + payloads (layout table as data)
    schedule_stats.ScheduleStats     per-L2-section totals
    schedule_scatter.ScheduleScatter fwd_work_desc in the spec 4.8 order
    materialize_k2q.K2QMaterialize   K2Q CSRs + payloads + dq_write_order(_full)
    builder.build_plan_gpu           the pipeline, one host read (the header)

What every attention consumer (flexattn_sm90, flexattn_sm100) does with a plan the same way::

    consumer_plan                    device: forward view tensors, task decode and SMEM hand-off,
                                     payload plane copy, packed-predicate bit-select
    consumer_softmax                 device: log2-domain constants, row max
    stage_fill                       device: TMA / bulk stage fills, zeroing a tile's rows past its sample
    consumer_launch                  host: pointers, input/output checks, view -> kernel arguments
"""

from .builder import build_plan_gpu, unserved
from .classify import ClassifyConfig, Q2KClassify, classify_gpu, compile_classify

__version__ = "0.1.0"

#: ``build_plan_gpu`` and ``unserved`` are what ``Consumer.gpu_planner = "maskplan_kernels"`` reads
__all__ = [
    "ClassifyConfig",
    "Q2KClassify",
    "__version__",
    "build_plan_gpu",
    "classify_gpu",
    "compile_classify",
    "unserved",
]
