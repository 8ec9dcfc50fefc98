"""CPU tier: ``build_plan_gpu``'s host pipeline with every kernel replaced by its CPU twin.

The twins (``kernel_twins.py``) take the kernels' exact positional signatures and pointer
semantics, so these tests check, without a GPU, the argument wiring of every launch, the upper
bounds and padding rows, the single header read, compaction, error translation, and the
algorithms the kernels implement (layout table packing, K2Q ranks, the schedule's bounded
counting). The device code itself is checked by ``test_builder_gpu.py`` on the GPU.
"""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest
import torch
from kernel_twins import TWINS, FakePtr
from plan_cases import assert_plans_equal, make_geometry, make_mask, row_major, view_config

from maskplan_core.consumer import Consumer
from maskplan_core.errors import EndpointError, SeqlenError
from maskplan_core.payload import RowMajorLayout
from maskplan_core.reference import build_plan


@pytest.fixture
def twins(monkeypatch):
    """Run build_plan_gpu on CPU tensors with the kernel twins; counts header reads."""
    import maskplan_kernels._launch as launch
    import maskplan_kernels.builder as builder
    from maskplan_kernels.payload_table import payload_source_table

    for name, twin in TWINS.items():
        monkeypatch.setattr(builder, name, lambda config, twin=twin: twin(config))
    monkeypatch.setattr(builder, "_PROGRAMS", type(builder._PROGRAMS)())  # programs hold compiled twins
    monkeypatch.setattr(builder, "int32_address", FakePtr.of)
    for module in (builder, launch):  # FakePtr arithmetic counts elements
        monkeypatch.setattr(module, "advance", lambda ptr, elements: ptr + elements)
    monkeypatch.setattr(builder, "torch_stream", lambda device: None)
    monkeypatch.setattr(builder, "persistent_ctas", lambda device, items, ctas_per_sm=1: 1)
    monkeypatch.setattr(builder, "device_source_table", lambda layout, device: payload_source_table(layout))
    monkeypatch.setattr(builder, "_check_inputs", lambda *args: None)
    reads = []
    real_read = builder.read_header

    def counting_read(build):
        reads.append(1)
        return real_read(build)

    monkeypatch.setattr(builder, "read_header", counting_read)
    return reads


def _build_both(geometry, mask, fwd_layout, bwd_layout, *, pack_gqa=False):
    from maskplan_kernels.builder import build_plan_gpu

    qpk = geometry.qhead_per_kvhead
    fwd = view_config(fwd_layout, "forward", pack_gqa=pack_gqa, qpk=qpk)
    bwd = view_config(bwd_layout, "backward", qpk=qpk) if bwd_layout is not None else None
    ref = build_plan(mask, geometry, fwd, bwd, "test")
    got = build_plan_gpu(mask, geometry, fwd, bwd, "test")
    return ref, got


CASES = [
    # q_lens, k_lens, varlen
    ([100, 100], [160, 160], False),
    ([70, 0, 33, 1, 65], [50, 90, 0, 5, 128], True),
    ([0, 0, 64], [10, 0, 64], True),
    ([129], [31], True),
    ([0], [0], True),  # no token at all: every plan row count is 0
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{len(c[0])}-{sum(c[0])}{'-varlen' if c[2] else ''}")
@pytest.mark.parametrize("nfunc", [1, 5])
@pytest.mark.parametrize("heads", [(2, 1, 1), (4, 2, 4)], ids=["hm1-gqa2", "hm4-gqa2"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_matches_reference(twins, case, nfunc, heads, backward):
    q_lens, k_lens, varlen = case
    hq, hkv, hmask = heads
    g = make_geometry(q_lens, k_lens, hq=hq, hkv=hkv, hmask=hmask, nfunc=nfunc, varlen=varlen)
    mask = make_mask(q_lens, k_lens, hmask, nfunc, seed=len(q_lens) * 10 + nfunc)
    ref, got = _build_both(g, mask, row_major(32, 16), row_major(16, 32) if backward else None)
    assert_plans_equal(ref, got)
    assert len(twins) == 1  # exactly one header read per build


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_empty_samples_with_max_seqlen_0(twins, backward):
    """``max_seqlen = seqlens.max()`` of a varlen batch of empty samples: no Q or K block at all."""
    g = make_geometry([0, 0], [0, 0], max_q=0, max_k=0)
    mask = make_mask([0, 0], [0, 0], 1, 3, seed=1)
    ref, got = _build_both(g, mask, row_major(32, 16), row_major(16, 32) if backward else None)
    assert_plans_equal(ref, got)


#: (forward, backward) layout arguments of the consumer's maker, by consumer
CONSUMER_LAYOUTS = {
    "sm90-st-64x64": ((64, 64), (64, 64, 2, True)),
    "sm90-s-64x96": ((64, 64), (64, 96, 2, False)),
    "sm100-256x128+128x256": ((256, 128, 1, False), (128, 256, 2, True)),  # two q subtiles; a K pair
    "sm100-d256": ((128, 128, 1, False), (64, 128, 1, True)),
}


@pytest.mark.parametrize("layouts", sorted(CONSUMER_LAYOUTS))
def test_consumer_layouts_and_tails(twins, layouts):
    if layouts.startswith("sm90-"):  # a consumer package: skipped where it is not installed
        make = pytest.importorskip("flexattn_sm90.payload_layout").wgmma_layout
    else:
        make = pytest.importorskip("flexattn_sm100.payload_layout").tmem_layout
    fwd_args, bwd_args = CONSUMER_LAYOUTS[layouts]
    q_lens, k_lens = [150, 0, 64, 300], [200, 7, 130, 290]
    g = make_geometry(q_lens, k_lens, hq=2, hkv=2, hmask=2, nfunc=3)
    mask = make_mask(q_lens, k_lens, 2, 3, seed=4)
    ref, got = _build_both(g, mask, make(*fwd_args), make(*bwd_args))
    assert_plans_equal(ref, got)


def test_pack_gqa_schedule(twins):
    q_lens, k_lens = [90, 40], [90, 200]
    g = make_geometry(q_lens, k_lens, hq=4, hkv=2, hmask=1, nfunc=3, varlen=True)
    mask = make_mask(q_lens, k_lens, 1, 3, seed=8)
    ref, got = _build_both(g, mask, row_major(16, 16), None, pack_gqa=True)
    assert_plans_equal(ref, got)


def test_schedule_sections_split_heads(twins, monkeypatch):
    """Several L2 sections per sample, a head count that is not a power of two, sections of
    different sizes per sample (a smaller section budget stands in for long sequences)."""
    import maskplan_core.reference.schedule as ref_schedule
    import maskplan_kernels._sections as sections

    budget = 64 * 512 * 2  # (Dqk + Dv) * 2 bytes = 512: two heads of a 64-key sample, four of a 20-key one
    monkeypatch.setattr(ref_schedule.heads_per_section, "__defaults__", (budget,))
    monkeypatch.setattr(sections.ScheduleParams.__init__, "__defaults__", (budget,))
    q_lens, k_lens = [64, 48], [64, 20]
    g = make_geometry(q_lens, k_lens, hq=6, hkv=6, hmask=6, nfunc=3, varlen=True, head_dim=128)
    mask = make_mask(q_lens, k_lens, 6, 3, seed=2)
    ref, got = _build_both(g, mask, row_major(16, 16), None)
    assert_plans_equal(ref, got)
    assert int(got.view("forward").fwd_work_desc[:, 2].ne(0).sum()) > 0


def test_program_is_shared_and_plans_own_their_storage(twins):
    """Builds of one pair of views share a compiled program (new varlen sizes add a sizes entry,
    not a program); each plan still owns its own tensors, so two plans never alias."""
    import maskplan_kernels.builder as builder
    from maskplan_kernels.builder import build_plan_gpu

    fwd = view_config(row_major(32, 16), "forward")
    bwd = view_config(row_major(16, 32), "backward")
    plans = []
    for q_lens, k_lens, seed in (([70, 33], [50, 90], 1), ([70, 33], [50, 90], 2), ([20, 90], [64, 30], 3)):
        g = make_geometry(q_lens, k_lens, hq=2, hkv=1, hmask=1, nfunc=3, varlen=True)
        mask = make_mask(q_lens, k_lens, 1, 3, seed=seed)
        got = build_plan_gpu(mask, g, fwd, bwd, "test")
        assert_plans_equal(build_plan(mask, g, fwd, bwd, "test"), got)
        plans.append(got)
    assert len(builder._PROGRAMS) == 1
    (program,) = builder._PROGRAMS.values()
    assert len(program._sizes) == 2  # the first two builds share their sizes
    storages = [
        {t.untyped_storage().data_ptr() for role in p.roles for t in p.view(role).tensors.values()}
        for p in plans
    ]
    assert not storages[0] & storages[1] and not storages[1] & storages[2]


def test_malformed_endpoints_raise_like_the_reference(twins):
    q_lens, k_lens = [40, 30], [50, 0]
    g = make_geometry(q_lens, k_lens, hq=1, hkv=1, hmask=1, nfunc=3)
    mask = make_mask(q_lens, k_lens, 1, 3, seed=1, kinds=("causal",))
    mask[0, 2, 45] = 1  # sample 1 has k_len 0
    fwd = view_config(row_major(16, 16), "forward")
    from maskplan_kernels.builder import build_plan_gpu

    with pytest.raises(EndpointError) as ref_err:
        build_plan(mask, g, fwd, None, "test")
    with pytest.raises(EndpointError) as got_err:
        build_plan_gpu(mask, g, fwd, None, "test")
    assert str(got_err.value) == str(ref_err.value)


@pytest.mark.parametrize("corrupt", ["start", "end", "decrease", "max"])
def test_malformed_prefixes_raise_like_the_reference(twins, corrupt):
    q_lens, k_lens = [40, 30, 20], [50, 10, 20]
    g = make_geometry(q_lens, k_lens, hq=1, hkv=1, hmask=1, nfunc=1)
    mask = make_mask(q_lens, k_lens, 1, 1, seed=3, kinds=("causal",))
    cu = g.cu_seqlens_k if corrupt != "max" else g.cu_seqlens_q
    if corrupt == "start":
        cu[0] = 1
    elif corrupt == "end":
        cu[-1] = cu[-1] + 5
    elif corrupt == "decrease":
        cu[1], cu[2] = cu[2], cu[1]
    else:
        cu[1] = 45  # sample 0 gets 45 > max_seqlen_q = 40 query rows
    fwd = view_config(row_major(16, 16), "forward")
    bwd = view_config(row_major(16, 16), "backward")
    from maskplan_kernels.builder import build_plan_gpu

    with pytest.raises(SeqlenError) as ref_err:
        build_plan(mask, g, fwd, bwd, "test")
    with pytest.raises(SeqlenError) as got_err:
        build_plan_gpu(mask, g, fwd, bwd, "test")
    assert str(got_err.value) == str(ref_err.value)


def test_fake_ptr_bounds():
    t = torch.zeros(2, 3, dtype=torch.int32)
    p = FakePtr.of(t[1])
    assert p.offset == 3
    with pytest.raises(IndexError):
        p.view(4)
    (p + 1).view(2)[:] = 7
    assert t.tolist() == [[0, 0, 0], [0, 7, 7]]


def test_endpoints_past_the_materialisers_budget_are_left_to_the_reference_planner():
    """``unserved`` names the views whose tiles' endpoints the materialisers cannot hold (128-row
    tiles: nfunc above 73; 64-row ones: above 153), so Consumer.build_plan plans those masks with
    the reference planner on the GPU instead of launching kernels that do not fit."""
    from maskplan_kernels.builder import max_nfunc, unserved

    fwd = view_config(RowMajorLayout(128, 128), "forward")
    bwd = view_config(RowMajorLayout(64, 128), "backward")
    assert (max_nfunc(fwd, "k"), max_nfunc(bwd, "q")) == (73, 153)
    for nfunc, why in ((73, None), (75, "at most 73 endpoints per row on 128 x 128 forward tiles")):
        g = make_geometry([300], [300], nfunc=nfunc)
        expected = why and f"the planner kernels take {why}, the mask has nfunc={nfunc}"
        assert unserved(g, fwd, bwd) == expected
    narrow = view_config(RowMajorLayout(32, 128), "forward")  # its 32-row tiles take more
    refusal = unserved(make_geometry([300], [300], nfunc=155), narrow, bwd)
    assert "at most 153 endpoints per row on 64 x 128 backward tiles" in refusal


class _PlannedByTheKernels(Consumer):
    """A consumer whose CUDA plans come from this package (what SM90's and SM100's declare)."""

    name, arch_families, gpu_planner = "planner-test", ("test",), "maskplan_kernels"

    def resolve(self, request):
        raise NotImplementedError

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def backward(self, *args, **kwargs):
        raise NotImplementedError


@pytest.mark.parametrize("nfunc, planner", [(73, "kernels"), (75, "reference")])
def test_a_consumer_leaves_masks_the_kernels_cannot_hold_to_the_reference_planner(
    nfunc, planner, monkeypatch
):
    """Consumer.build_plan on CUDA endpoints (a stand-in here: no GPU) asks the package it names
    for ``unserved`` and plans with its kernels, or, past their limit, with the reference planner
    and a warning that names the limit."""
    import maskplan_core.consumer as consumer_module
    import maskplan_core.reference.builder as reference_builder
    import maskplan_kernels

    built = []
    monkeypatch.setattr(maskplan_kernels, "build_plan_gpu", lambda *args: built.append("kernels"))
    monkeypatch.setattr(reference_builder, "build_plan", lambda *args: built.append("reference"))
    monkeypatch.setattr(consumer_module, "on_device", lambda device: contextlib.nullcontext())
    cuda_mask = types.SimpleNamespace(device=torch.device("cuda", 0))
    fwd, bwd = (
        view_config(RowMajorLayout(128, 128), "forward"),
        view_config(RowMajorLayout(64, 128), "backward"),
    )
    geometry = make_geometry([300], [300], nfunc=nfunc)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _PlannedByTheKernels().build_plan(cuda_mask, geometry, fwd, bwd)
    assert built == [planner]
    limit = [str(w.message) for w in said if "at most 73 endpoints per row" in str(w.message)]
    assert len(limit) == (planner == "reference")
