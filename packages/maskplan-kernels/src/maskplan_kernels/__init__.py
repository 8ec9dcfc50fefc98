"""Architecture-neutral MaskPlan planner kernels in CuTe DSL (spec section 4).

Importing this package imports CuTe DSL (``cutlass``); ``maskplan_core`` never imports it.
Every kernel has a pure-torch twin in ``maskplan_core.reference`` and is tested bit-exactly
against it on the GPU; CI compiles every kernel for ``CUTE_DSL_ARCH=sm_90a`` without a GPU.
"""

from .classify import ClassifyConfig, Q2KClassify, classify_gpu, compile_classify

__all__ = ["ClassifyConfig", "Q2KClassify", "classify_gpu", "compile_classify"]
