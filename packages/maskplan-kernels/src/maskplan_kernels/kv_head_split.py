"""Into how many items a K-major backward splits each (K row, kv head) item's q heads
(``BackwardCompiler.kv_head_split``): the rule SM90's backward measured on an H100, which SM100's
takes unmeasured (no SM100 hardware here)."""

#: (K row, kv head) items per SM below which :func:`kv_head_split` splits each kv head's q heads,
#: and where the longest K2Q row is UNEVEN_ROW_SPREAD times the mean or more
MIN_ITEMS_PER_SM, MIN_ITEMS_PER_SM_UNEVEN, UNEVEN_ROW_SPREAD = 6, 12, 1.5


def kv_head_split(items: int, q_per_kv: int, sms: int, row_spread: float = 1.0) -> int:
    """Into how many items (``consumer_launch.launch_backward``'s ``kv_split``) the backward splits
    each (K row, kv head) item's ``q_per_kv`` q heads: doubled while there are fewer than
    ``MIN_ITEMS_PER_SM`` items per SM (``MIN_ITEMS_PER_SM_UNEVEN`` where ``row_spread``, the
    longest K2Q row against the mean, is ``UNEVEN_ROW_SPREAD`` or more: causal and document
    masks) and the parts still divide ``q_per_kv``. An item walks its K row once per q head, so
    with few kv heads a handful of long items sets the kernel's length: MQA (Hq = 32, Hkv = 1) at
    S = 8192, B = 2 made 128 items for 132 SMs, the longest causal K rows twice the mean, and ran
    fwd+bwd at 0.63x cuDNN (H100, benchmarks/RESULTS.md, session 57). A part costs a dK and a dV
    of its own (``(total_k, Hkv, D)``, written, then read by the sum), and K / V loads: where K
    rows are about as long (sliding windows, dense rows) 12 items per SM instead of 6 lost 9-15%
    fwd+bwd, where they differ it gained up to 10% (MQA 64 causal and documents; session 60; the
    rule at MQA 64: +9% and +11%, session 61)."""
    per_sm = MIN_ITEMS_PER_SM_UNEVEN if row_spread >= UNEVEN_ROW_SPREAD else MIN_ITEMS_PER_SM
    split = 1
    while items * split < per_sm * sms and q_per_kv % (2 * split) == 0:
        split *= 2
    return split


def no_kv_head_split(items: int, q_per_kv: int, sms: int, row_spread: float) -> int:
    """A main kernel that does not split kv heads' q heads (``BackwardCompiler``'s default)."""
    return 1
