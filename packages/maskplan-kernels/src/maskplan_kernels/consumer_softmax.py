"""Online-softmax pieces an attention consumer shares whatever its accumulator layout (CuTe DSL).

Both forward consumers keep the running max of raw (unscaled) scores and work in the log2 domain:
``P = 2^(s * scale * LOG2_E - max * scale * LOG2_E)``, ``LSE = (max * scale * LOG2_E + log2 sum) * LN_2``.
How rows map to threads (a quad of lanes on SM90, one thread on SM100) stays with the consumer.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@cute.jit
def row_max_of(row: cute.Tensor, init: Float32) -> Float32:
    """Max of a register row and ``init``, as a 4-way tree (short dependency chains)."""
    n = cute.size(row)
    m = [init, row[0], row[1], row[2]]
    for c in cutlass.range_constexpr(3, n):
        m[c % 4] = cute.arch.fmax(m[c % 4], row[c])
    return cute.arch.fmax(cute.arch.fmax(m[0], m[1]), cute.arch.fmax(m[2], m[3]))


__all__ = ["LN_2", "LOG2_E", "row_max_of"]
