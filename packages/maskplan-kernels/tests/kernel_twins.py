"""CPU twins of the planner kernels, for testing the GPU pipeline's HOST side without a GPU.

Each twin has the positional signature of its kernel's ``@cute.jit __call__`` (checked by name
with ``inspect``), receives :class:`FakePtr` "pointers" (a tensor storage + element offset, so
pointer arithmetic and sub-tensor pointers behave like device addresses) and the same runtime
sizes, and writes what the device kernel's docstring says it writes, following the kernel's own
algorithm (padding rows, the dummy sample, packed scans, bitmap + layout table, per-warp
histograms, match groups, ...). With the twins patched in, ``build_plan_gpu`` runs on CPU tensors
and must equal ``maskplan_core.reference.build_plan``: this checks argument order, sizes,
upper bounds, compaction and the algorithms; the GPU tier then checks the device code itself.
"""

from __future__ import annotations

import inspect

import torch

from maskplan_core.error_flags import (
    CU_K_END,
    CU_K_MAX,
    CU_K_ORDER,
    CU_K_START,
    CU_Q_END,
    CU_Q_MAX,
    CU_Q_ORDER,
    CU_Q_START,
    ENDPOINT_ORDER,
    ENDPOINT_RANGE,
)

WARP = 32


class FakePtr:
    """A device pointer stand-in: the whole storage of a tensor plus an element offset."""

    def __init__(self, storage: torch.Tensor, offset: int):
        self.storage, self.offset = storage, offset

    @classmethod
    def of(cls, t: torch.Tensor) -> FakePtr:
        if t.dtype != torch.int32:
            raise TypeError(f"planner kernels take int32 tensors, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"planner kernels take contiguous tensors, got strides {t.stride()}")
        storage = torch.empty(0, dtype=torch.int32).set_(t.untyped_storage())
        return cls(storage, t.storage_offset())

    def __add__(self, n: int) -> FakePtr:
        return FakePtr(self.storage, self.offset + int(n))

    def view(self, *shape: int) -> torch.Tensor:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= max(int(s), 1)
        n = 1
        for s in shape:
            n *= int(s)
        if n and self.offset + n > self.storage.numel():
            raise IndexError(f"pointer view {shape} at offset {self.offset} passes the end of its allocation")
        return torch.as_strided(
            self.storage, tuple(int(s) for s in shape), tuple(reversed(strides)), self.offset
        )

    def view_rows(self, rows: int, *rest: int) -> torch.Tensor:
        """A ``(rows, *rest)`` view for a buffer whose row count the kernel got as a layout extent
        (``max(n, 1)``): clamped to the allocation, so an empty buffer gives an empty view and any
        access past the real rows still fails."""
        per_row = 1
        for s in rest:
            per_row *= int(s)
        available = (self.storage.numel() - self.offset) // max(per_row, 1)
        return self.view(min(int(rows), max(available, 0)), *rest)


def _bind(kernel_cls, args) -> dict:
    names = list(inspect.signature(kernel_cls.__call__).parameters)[1:]
    if len(args) != len(names):
        raise TypeError(f"{kernel_cls.__name__} takes {len(names)} arguments ({names}), got {len(args)}")
    return dict(zip(names, args, strict=True))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _to_i32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


# ------------------------------------------------------------------------------------------------
# geometry


def geometry_twin(config):
    from maskplan_kernels.geometry import VarlenGeometry

    def run(*args):
        a = _bind(VarlenGeometry, args)
        B = int(a["batch"])
        cu_q, cu_k = a["cu_seqlens_q"].view(B + 1).tolist(), a["cu_seqlens_k"].view(B + 1).tolist()
        max_q, max_k = int(a["max_seqlen_q"]), int(a["max_seqlen_k"])
        flags = 0
        if int(a["validate"]):
            for cu, total, mx, bits in (
                (cu_q, a["total_q"], max_q, (CU_Q_START, CU_Q_END, CU_Q_ORDER, CU_Q_MAX)),
                (cu_k, a["total_k"], max_k, (CU_K_START, CU_K_END, CU_K_ORDER, CU_K_MAX)),
            ):
                flags |= bits[0] if cu[0] != 0 else 0
                flags |= bits[1] if cu[B] != int(total) else 0
                for b in range(B):
                    n = cu[b + 1] - cu[b]
                    flags |= bits[2] if n < 0 else 0
                    flags |= bits[3] if n > mx else 0
        ok = flags == 0
        samples = []
        for b in range(B):
            if ok:
                q_off, k_off = cu_q[b], cu_k[b]
                q_len = min(max(cu_q[b + 1] - q_off, 0), max_q)
                k_len = min(max(cu_k[b + 1] - k_off, 0), max_k)
            else:
                q_off = k_off = q_len = k_len = 0
            samples.append((q_off, k_off, q_len, k_len))

        def fill(desc_ptr, rb_ptr, upper, tile_outer, tile_inner, outer_is_q):
            desc = desc_ptr.view(B + 1, 8)
            begin = 0
            for b, (q_off, k_off, q_len, k_len) in enumerate(samples):
                q_blocks = _cdiv(q_len, tile_outer if outer_is_q else tile_inner)
                k_blocks = _cdiv(k_len, tile_inner if outer_is_q else tile_outer)
                count, inner = (q_blocks, k_blocks) if outer_is_q else (k_blocks, q_blocks)
                desc[b] = torch.tensor(
                    [q_off, k_off, q_len, k_len, begin, count, inner, 0], dtype=torch.int32
                )
                begin += count
            desc[B] = 0
            rb = rb_ptr.view(upper) if upper else None  # no plan row: nothing is written
            for b in range(B):
                r0, cnt = int(desc[b, 4]), int(desc[b, 5])
                for r in range(r0, r0 + cnt):
                    if r < upper:
                        rb[r] = b
            for r in range(begin, upper):
                rb[r] = B
            return begin

        tm_f, tn_f = int(a["tile_m_fwd"]), int(a["tile_n_fwd"])
        n_f = fill(a["desc_fwd"], a["row_batch_fwd"], int(a["uq_fwd"]), tm_f, tn_f, True)
        n_bq = n_bk = 0
        if config.has_backward:
            tm_b, tn_b = int(a["tile_m_bwd"]), int(a["tile_n_bwd"])
            n_bq = fill(a["desc_bwd_q"], a["row_batch_bwd_q"], int(a["uq_bwd"]), tm_b, tn_b, True)
            # the "k" descriptor: outer = K blocks (tile_n), inner = Q blocks (tile_m)
            n_bk = fill(a["desc_bwd_k"], a["row_batch_bwd_k"], int(a["uk_bwd"]), tn_b, tm_b, False)
        a["header"].view(8)[:] = torch.tensor([n_f, 0, 0, n_bq, n_bk, 0, 0, flags], dtype=torch.int32)

    return run


# ------------------------------------------------------------------------------------------------
# classify (the hardware-verified kernel; its twin states its contract)


def _row_visibility(ends: torch.Tensor, k_cols: int) -> torch.Tensor:
    """bool [rows, k_cols]: odd number of G = [0, F0, ...] values <= key."""
    g = torch.cat([torch.zeros(ends.shape[0], 1, dtype=torch.int64), ends.to(torch.int64)], 1)
    keys = torch.arange(k_cols, dtype=torch.int64)
    return ((g[:, :, None] <= keys).sum(1) % 2) == 1


def classify_twin(config):
    from maskplan_kernels.classify import Q2KClassify

    tm, tn, nfunc = config.tile_m, config.tile_n, config.nfunc

    def run(*args):
        a = _bind(Q2KClassify, args)
        H, total_q, rows, kw, bp1 = (int(a[k]) for k in ("hmask", "total_q", "n_q_rows", "k_words", "batch"))
        mask = a["mask_func"].view(H, nfunc, total_q)
        rb, desc = a["row_batch"].view(rows), a["sequence_desc"].view(bp1, 8)
        vis_out, full_out = a["visible_bits"].view(H, rows, kw), a["full_bits"].view(H, rows, kw)
        pc, fc = a["partial_counts"].view(H, rows), a["full_counts"].view(H, rows)
        err = 0
        for r in range(rows):
            b = int(rb[r])
            q_off, q_len, k_len, begin = (int(desc[b, c]) for c in (0, 2, 3, 4))
            local = (r - begin) * tm + torch.arange(tm)
            valid = (local < q_len) & (q_off + local < total_q)
            tokens = (q_off + local)[valid]
            for h in range(H):
                ends = mask[h][:, tokens].T  # [rows, nfunc]
                if ends.numel():
                    if bool(((ends < 0) | (ends > k_len)).any()):
                        err |= ENDPOINT_RANGE
                    if bool((ends[:, 1:] < ends[:, :-1]).any()):
                        err |= ENDPOINT_ORDER
                vis_k = _row_visibility(ends.clamp(0, max(k_len, 0)), kw * 32 * tn) & (
                    torch.arange(kw * 32 * tn) < k_len
                )
                blocks = vis_k.reshape(vis_k.shape[0], kw * 32, tn)
                visible = blocks.any(2).any(0)
                full = torch.zeros(kw * 32, dtype=torch.bool)
                if int(valid.sum()) == tm:
                    full = blocks.all(2).all(0) & ((torch.arange(kw * 32) + 1) * tn <= k_len)
                vis_out[h, r] = _pack_words(visible)
                full_out[h, r] = _pack_words(full)
                pc[h, r] = int((visible & ~full).sum())
                fc[h, r] = int(full.sum())
        if err:
            a["error_word"].view(1)[0] |= err

    return run


def _pack_words(bits: torch.Tensor) -> torch.Tensor:
    w = (bits.reshape(-1, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


# ------------------------------------------------------------------------------------------------
# K2Q count


def k2q_count_twin(config):
    from maskplan_kernels.k2q_count import K2QCount

    def run(*args):
        a = _bind(K2QCount, args)
        H, uq, uk, kw, bp1 = (int(a[k]) for k in ("hmask", "uq", "uk", "k_words", "batch_plus_one"))
        vis, full = a["visible_bits"].view_rows(H, uq, kw), a["full_bits"].view_rows(H, uq, kw)
        rbk = a["row_batch_k"].view(uk)
        dq, dk = a["desc_q"].view(bp1, 8), a["desc_k"].view(bp1, 8)
        pc, fc = a["partial_counts"].view(H, uk), a["full_counts"].view(H, uk)
        W = config.num_warps
        for h in range(H):
            for kr in range(uk):
                b = int(rbk[kr])
                j = kr - int(dk[b, 4])
                q0, qn = int(dq[b, 4]), int(dq[b, 5])
                p = f = 0
                for w in range(W):  # the warps' contiguous slices
                    for m in range(qn * w // W, qn * (w + 1) // W):
                        v = (int(vis[h, q0 + m, j // 32]) >> (j % 32)) & 1
                        x = (int(full[h, q0 + m, j // 32]) >> (j % 32)) & 1
                        p += v & (x ^ 1)
                        f += x
                pc[h, kr], fc[h, kr] = p, f

    return run


# ------------------------------------------------------------------------------------------------
# scan + header


def scan_header_twin(config):
    from maskplan_kernels.scan_header import HEADER_SLOTS, ScanHeader

    def run(*args):
        a = _bind(ScanHeader, args)
        header = a["header"].view(8)
        names = [
            ("fwd_partial_counts", "fwd_partial_offsets", "n_fwd"),
            ("fwd_full_counts", "fwd_full_offsets", "n_fwd"),
            ("k2q_partial_counts", "k2q_partial_offsets", "n_bwd"),
            ("k2q_full_counts", "k2q_full_offsets", "n_bwd"),
        ][: config.num_arrays]
        for (c, o, n), slot in zip(names, HEADER_SLOTS, strict=False):
            n = int(a[n])
            cnt, off = a[c].view(n), a[o].view(n)
            run_total = 0
            for i in range(n):
                off[i] = run_total
                run_total += int(cnt[i])
            header[slot] = run_total

    return run


# ------------------------------------------------------------------------------------------------
# payload: bitmap + table (mirrors TilePacker)


def _tile_payload(mask, head, q_off, first_local, q_len, total_q, n_block, k_len, tm, tn, nfunc, table, wpt):
    from maskplan_kernels.payload_table import bitmap_row_base, bitmap_words, row_words

    rw = row_words(tn)
    bitmap = [0] * bitmap_words(tm, tn)
    for t in range(tm):
        local, tok = first_local + t, q_off + first_local + t
        ok = local < q_len and 0 <= tok < total_q
        ends = [int(mask[head, f, tok]) if ok else 0 for f in range(nfunc)]
        for c in range(rw):
            x0 = n_block * tn + c * 32
            lim = max(min(min(tn - c * 32, 32), k_len - x0), 0)
            word = 0
            for i in range((nfunc + 1) // 2):
                start = 0 if i == 0 else ends[2 * i - 1]
                end = ends[2 * i]
                lo = min(max(start - x0, 0), lim)
                hi = max(min(max(end - x0, 0), lim), lo)
                word |= ((1 << hi) - (1 << lo)) & 0xFFFFFFFF
            bitmap[bitmap_row_base(t, tn) + c] = word
    out = []
    for w in range(wpt):
        word = 0
        for b in range(32):
            addr = int(table[w * 32 + b])
            word |= ((bitmap[addr >> 5] >> (addr & 31)) & 1) << b
        out.append(_to_i32(word))
    return torch.tensor(out, dtype=torch.int32)


def q2k_materialize_twin(config):
    from maskplan_kernels.materialize_q2k import Q2KMaterialize

    tm, tn, nfunc, wpt = config.tile_m, config.tile_n, config.nfunc, config.words_per_tile

    def run(*args):
        a = _bind(Q2KMaterialize, args)
        H, total_q, uq, kw, n_rows, bp1 = (
            int(a[k]) for k in ("hmask", "total_q", "uq", "k_words", "n_rows", "batch_plus_one")
        )
        nnz_p, nnz_f = int(a["nnz_p"]), int(a["nnz_f"])
        mask = a["mask_func"].view(H, nfunc, total_q)
        rb, desc = a["row_batch"].view(uq), a["sequence_desc"].view(bp1, 8)
        vis, full = a["visible_bits"].view(H, uq, kw), a["full_bits"].view(H, uq, kw)
        ws = a["counts_ws"].view(4, H, uq)
        out = a["counts_out"].view(4, H, max(n_rows, 1))
        idx_p, idx_f = a["partial_idx"].view_rows(nnz_p), a["full_idx"].view_rows(nnz_f)
        masks = a["masks"].view_rows(nnz_p, wpt)
        table = a["table"].view(wpt * 32)
        for item in range(H * n_rows):
            h, r = divmod(item, n_rows)
            b = int(rb[r])
            q_off, q_len, k_len, begin = (int(desc[b, c]) for c in (0, 2, 3, 4))
            cp, cf, op, of = (int(ws[i, h, r]) for i in range(4))
            if int(a["write_compact"]):
                out[:, h, r] = ws[:, h, r]
            pos_p, pos_f = op, of
            for w in range(kw):
                v, f = int(vis[h, r, w]) & 0xFFFFFFFF, int(full[h, r, w]) & 0xFFFFFFFF
                for bit in range(32):
                    if (f >> bit) & 1:
                        idx_f[pos_f] = w * 32 + bit
                        pos_f += 1
                    elif (v >> bit) & 1:
                        idx_p[pos_p] = w * 32 + bit
                        masks[pos_p] = _tile_payload(
                            mask,
                            h,
                            q_off,
                            (r - begin) * tm,
                            q_len,
                            total_q,
                            w * 32 + bit,
                            k_len,
                            tm,
                            tn,
                            nfunc,
                            table,
                            wpt,
                        )
                        pos_p += 1
            assert (pos_p - op, pos_f - of) == (cp, cf), "counts disagree with the bitsets"

    return run


def k2q_materialize_twin(config):
    from maskplan_kernels.materialize_k2q import K2QMaterialize

    tm, tn, nfunc, wpt = config.tile_m, config.tile_n, config.nfunc, config.words_per_tile

    def run(*args):
        a = _bind(K2QMaterialize, args)
        H, total_q, uq, uk, kw, n_k, bp1 = (
            int(a[k]) for k in ("hmask", "total_q", "uq", "uk", "k_words", "n_k_rows", "batch_plus_one")
        )
        nnz_p, nnz_f = int(a["nnz_p"]), int(a["nnz_f"])
        mask = a["mask_func"].view(H, nfunc, total_q)
        rbk = a["row_batch_k"].view(uk)
        dq, dk = a["desc_q"].view(bp1, 8), a["desc_k"].view(bp1, 8)
        vis, full = a["visible_bits"].view(H, uq, kw), a["full_bits"].view(H, uq, kw)
        ws, out = a["counts_ws"].view(4, H, uk), a["counts_out"].view(4, H, max(n_k, 1))
        idx_p, idx_f = a["partial_idx"].view_rows(nnz_p), a["full_idx"].view_rows(nnz_f)
        dq_p, dq_f = a["dq_order"].view_rows(nnz_p), a["dq_order_full"].view_rows(nnz_f)
        masks, table = a["masks"].view_rows(nnz_p, wpt), a["table"].view(wpt * 32)
        for item in range(H * n_k):
            h, kr = divmod(item, n_k)
            b = int(rbk[kr])
            j = kr - int(dk[b, 4])
            q0, qn, q_off, q_len, k_len = (int(dq[b, c]) for c in (4, 5, 0, 2, 3))
            cp, cf, op, of = (int(ws[i, h, kr]) for i in range(4))
            if int(a["write_compact"]):
                out[:, h, kr] = ws[:, h, kr]
            pos_p, pos_f = op, of
            for m in range(qn):
                r = q0 + m
                v = int(vis[h, r, j // 32]) & 0xFFFFFFFF
                f = int(full[h, r, j // 32]) & 0xFFFFFFFF
                if not (v >> (j % 32)) & 1:
                    continue
                rank = bin(v & ((1 << (j % 32)) - 1)).count("1")
                rank += sum(bin(int(vis[h, r, w]) & 0xFFFFFFFF).count("1") for w in range(j // 32))
                if (f >> (j % 32)) & 1:
                    idx_f[pos_f], dq_f[pos_f] = m, rank
                    pos_f += 1
                else:
                    idx_p[pos_p], dq_p[pos_p] = m, rank
                    masks[pos_p] = _tile_payload(
                        mask, h, q_off, m * tm, q_len, total_q, j, k_len, tm, tn, nfunc, table, wpt
                    )
                    pos_p += 1
            assert (pos_p - op, pos_f - of) == (cp, cf), "K2Q counts disagree with the bitsets"

    return run


# ------------------------------------------------------------------------------------------------
# forward schedule


def _section_heads(s, desc, hkv, qpk, pack, row_bytes, budget):
    b, i = divmod(s, hkv)
    kv_bytes = int(desc[b, 3]) * row_bytes
    hps = 1
    while hps * 2 <= hkv and kv_bytes * hps * 2 <= budget:
        hps *= 2
    kv0 = i * hps
    if kv0 >= hkv:
        return b, 0, 0
    kv1 = min(kv0 + hps, hkv)
    return (b, kv0, kv1 - kv0) if pack else (b, kv0 * qpk, (kv1 - kv0) * qpk)


def _cost(pc, fc, head, row, per_head):
    mh = head if per_head else 0
    return int(pc[mh, row]) + int(fc[mh, row])


def schedule_stats_twin(config):
    from maskplan_kernels.schedule_stats import ScheduleStats

    def run(*args):
        a = _bind(ScheduleStats, args)
        H, uq, bp1, ns = (int(a[k]) for k in ("hmask", "uq", "batch_plus_one", "num_sections"))
        pc, fc = a["counts"].view(H, uq), (a["counts"] + H * uq).view(H, uq)
        desc, stats = a["sequence_desc"].view(bp1, 8), a["stats"].view(ns, 4)
        sec = [int(a[k]) for k in ("num_heads_kv", "qhead_per_kvhead", "pack_gqa", "row_bytes_kv", "budget")]
        for s in range(ns):
            b, h0, nh = _section_heads(s, desc, sec[0], sec[1], sec[2], sec[3], sec[4])
            qn, r0 = int(desc[b, 5]), int(desc[b, 4])
            costs = [
                _cost(pc, fc, h0 + t // qn, r0 + t % qn, int(a["mask_per_head"])) for t in range(nh * qn)
            ]
            pos = sum(c > 0 for c in costs)
            stats[s] = torch.tensor([sum(costs), pos, len(costs) - pos, 0], dtype=torch.int32)

    return run


def schedule_scatter_twin(config):
    from maskplan_kernels.schedule_scatter import ScheduleScatter

    W, bins = config.num_warps, config.bins

    def run(*args):
        a = _bind(ScheduleScatter, args)
        H, uq, bp1, ns, nt = (
            int(a[k]) for k in ("hmask", "uq", "batch_plus_one", "num_sections", "num_tasks")
        )
        pc, fc = a["counts"].view(H, uq), (a["counts"] + H * uq).view(H, uq)
        desc, stats, work = a["sequence_desc"].view(bp1, 8), a["stats"].view(ns, 4), a["work"].view(nt, 4)
        sec = [int(a[k]) for k in ("num_heads_kv", "qhead_per_kvhead", "pack_gqa", "row_bytes_kv", "budget")]
        per_head, tm = int(a["mask_per_head"]), int(a["tile_m"])
        for s in range(ns):  # one CTA per section
            b, h0, nh = _section_heads(s, desc, *sec)
            qn, r0, q_len, max_cost = (int(desc[b, c]) for c in (5, 4, 2, 6))
            tasks = nh * qn
            if tasks == 0:
                continue
            assert max_cost + 1 <= bins
            my = int(stats[s, 0])
            pos_start = sum(
                int(stats[x, 1])
                for x in range(ns)
                if int(stats[x, 0]) > my or (int(stats[x, 0]) == my and x < s)
            )
            zero_start = sum(int(stats[x, 1]) for x in range(ns)) + sum(int(stats[x, 2]) for x in range(s))
            task = [(h0 + t // qn, t % qn) for t in range(tasks)]
            cost = [_cost(pc, fc, hd, r0 + m, per_head) for hd, m in task]
            slices = [range(tasks * w // W, tasks * (w + 1) // W) for w in range(W)]
            hist = [[0] * (max_cost + 1) for _ in range(W)]
            for w, sl in enumerate(slices):
                for t in sl:
                    hist[w][cost[t]] += 1
            start = [0] * (max_cost + 1)
            for c in range(max_cost + 1):
                run_ = 0
                for w in range(W):
                    hist[w][c], run_ = run_, run_ + hist[w][c]
                start[c] = run_
            carry = 0
            for c in range(max_cost, 0, -1):
                start[c], carry = pos_start + carry, carry + start[c]
            start[0] = zero_start
            for w, sl in enumerate(slices):
                for t0 in range(sl.start, sl.stop, WARP):
                    lanes = [t for t in range(t0, t0 + WARP) if t < sl.stop]
                    for t in lanes:  # rank among earlier lanes of equal cost (match.any + lanemask_lt)
                        rank = sum(1 for u in lanes if u < t and cost[u] == cost[t])
                        slot = start[cost[t]] + hist[w][cost[t]] + rank
                        hd, m = task[t]
                        work[slot] = torch.tensor([m, hd, b, min(q_len - m * tm, tm)], dtype=torch.int32)
                    for c in {cost[t] for t in lanes}:
                        hist[w][c] += sum(1 for t in lanes if cost[t] == c)

    return run


TWINS = {
    "compile_geometry": geometry_twin,
    "compile_classify": classify_twin,
    "compile_k2q_count": k2q_count_twin,
    "compile_scan_header": scan_header_twin,
    "compile_q2k_materialize": q2k_materialize_twin,
    "compile_k2q_materialize": k2q_materialize_twin,
    "compile_schedule_stats": schedule_stats_twin,
    "compile_schedule_scatter": schedule_scatter_twin,
}
