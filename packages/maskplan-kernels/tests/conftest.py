"""maskplan-kernels tests: pick the CuTe DSL target before anything imports cutlass.

Compile-only tests need ``CUTE_DSL_ARCH`` (no GPU is needed to compile); sm_90a unless the caller
chose another target (the planner kernels are architecture-neutral, so sm_100a compiles too).
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
