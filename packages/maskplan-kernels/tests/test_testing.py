"""The test support of maskplan_kernels.testing on synthetic PTX, ptxas reports and SMEM offsets (no
compile, no GPU)."""

import re
import shutil

import pytest

import maskplan_kernels.testing as support
from maskplan_kernels.testing import (
    REQUIRE_PTXAS,
    assert_ptxas_clean,
    assert_row_view,
    assert_waits_before_global_access,
    ptxas_report,
    spill_bytes,
)

PROLOGUE = "\tld.param.u64 \t%rd1, [k_param_0];\n\tprefetch.tensormap [%rd1];\n\tbar.sync \t0;\n"
WAIT = "\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n"
BODY = "\tld.global.b32 \t%r1, [%rd2];\n\tst.global.v4.b32 \t[%rd3], {%r1, %r1, %r1, %r1};\n"


def test_a_kernel_that_waits_first_passes():
    assert_waits_before_global_access(PROLOGUE + WAIT + BODY)


@pytest.mark.parametrize(
    "early",
    [
        "\tld.global.nc.v4.u32 \t{%r1, %r2, %r3, %r4}, [%rd2];\n",
        "\t@%p1 st.global.b32 \t[%rd2], %r1;\n",
        "\tld.u32 \t%r1, [%rd2];\n",  # generic address: may be global
        "\tatom.global.add.u32 \t%r1, [%rd2], 1;\n",
        "\tred.release.gpu.global.add.s32 \t[%rd2], 1;\n",
        "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1];\n",
        "\tcp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%rd2], [%r1], 512;\n",
    ],
    ids=["ld.global", "predicated st.global", "generic ld", "atom", "red", "TMA load", "bulk add"],
)
def test_a_global_access_before_the_wait_fails(early):
    with pytest.raises(AssertionError, match="before griddepcontrol.wait"):
        assert_waits_before_global_access(PROLOGUE + early + WAIT + BODY)


@pytest.mark.parametrize("local", ["\tld.shared.u32 \t%r1, [%r2];\n", "\tst.local.u32 \t[%rd2], %r1;\n"])
def test_shared_and_local_accesses_may_come_first(local):
    assert_waits_before_global_access(PROLOGUE + local + WAIT + BODY)


def test_a_kernel_without_the_wait_fails():
    with pytest.raises(AssertionError, match="no griddepcontrol.wait"):
        assert_waits_before_global_access(PROLOGUE + BODY)


def _report(*spills: tuple[int, int]) -> str:
    """A ``ptxas -v`` report of one kernel per ``(store bytes, load bytes)``."""
    return "".join(
        f"ptxas info    : Function properties for k{i}\n    {st} bytes stack frame, {st} bytes spill stores, "
        f"{ld} bytes spill loads\nptxas info    : Used 168 registers, used 16 barriers\n"
        for i, (st, ld) in enumerate(spills)
    )


@pytest.mark.parametrize(
    "spills,expect", [([(0, 0)], 0), ([(44, 68)], 68), ([(0, 0), (60, 12)], 60), ([], 0)]
)
def test_spill_bytes_is_the_largest_of_any_kernel(spills, expect):
    assert spill_bytes(_report(*spills)) == expect


CLEAN = _report((0, 0))


@pytest.mark.parametrize(
    "note",
    [
        "(C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "insufficient register resources for the function 'k'",
        "(C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to the "
        "presence of Extern calls in the function 'k'",
        "(C7517) Potential Performance Loss: wgmma.wait_group is injected in function 'k'",
    ],
)
def test_a_serialised_wgmma_pipeline_is_not_clean(monkeypatch, tmp_path, note):
    monkeypatch.setattr(support, "ptxas_report", lambda ptx, arch, workdir: CLEAN)
    assert_ptxas_clean("ptx", "sm_90a", tmp_path)
    noted = f"ptxas info    : {note}\n" + CLEAN
    monkeypatch.setattr(support, "ptxas_report", lambda ptx, arch, workdir: noted)
    with pytest.raises(AssertionError, match=re.escape(note[:7])):
        assert_ptxas_clean("ptx", "sm_90a", tmp_path)


def _blocked_rows(rows: int, cols: int, w: int) -> list[list[int]]:
    """Offsets of a tile laid out as blocks of ``w`` columns, each ``rows`` rows of ``w`` elements."""
    return [[r * w + c % w + c // w * rows * w for c in range(0, cols, 8)] for r in range(rows)]


@pytest.mark.parametrize(
    "rows, cols, bits", [(128, 128, 3), (64, 256, 3), (128, 96, 2), (128, 32, 2), (64, 16, 0)]
)
def test_a_row_view_tile_passes(rows, cols, bits):
    assert_row_view(_blocked_rows(rows, cols, (16 << bits) // 2), (bits, 4, 3))


@pytest.mark.parametrize(
    "offsets, swizzle",
    [
        (_blocked_rows(128, 128, 32), (3, 4, 3)),  # rows narrower than the swizzle's
        ([[c + r * 128 for c in range(0, 128, 8)] for r in range(128)], (3, 4, 3)),  # plain row-major
        ([[r + c * 128 for c in range(0, 128, 8)] for r in range(128)], (3, 4, 3)),  # column-major
        (_blocked_rows(128, 128, 64), (3, 3, 3)),  # a swizzle that moves 8-byte pieces across rows
    ],
    ids=["narrow rows", "row-major", "column-major", "sub-piece swizzle"],
)
def test_a_tile_that_is_not_the_row_view_fails(offsets, swizzle):
    with pytest.raises(AssertionError):
        assert_row_view(offsets, swizzle)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")
def test_a_ptxas_error_shows_its_messages(tmp_path):
    ptx = ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k() { not_an_instruction; }\n"
    with pytest.raises(RuntimeError, match=r"(?s)exited \d+ on .*kernel\.ptx.*not_an_instruction"):
        ptxas_report(ptx, "sm_90a", tmp_path)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")
def test_ptx_of_an_isa_newer_than_ptxas_is_not_checked(tmp_path):
    ptx = ".version 99.0\n.target sm_90a\n.address_size 64\n.visible .entry k() { ret; }\n"
    assert ptxas_report(ptx, "sm_90a", tmp_path) is None
    assert ptxas_report(ptx.replace("99.0", "8.0"), "sm_90a", tmp_path) is not None


def test_ptx_no_ptxas_reads_is_reported(tmp_path, monkeypatch):
    """assert_ptxas_clean on PTX no ptxas reads (an ISA from the future) warns that nothing was
    checked, and fails where REQUIRE_PTXAS is 1 (the noxfile's compile sessions)."""
    ptx = ".version 99.0\n.target sm_90a\n.address_size 64\n.visible .entry k() { ret; }\n"
    monkeypatch.delenv(REQUIRE_PTXAS, raising=False)
    with pytest.warns(UserWarning, match="sm_90a register spills and WGMMA pipeline are unchecked"):
        assert_ptxas_clean(ptx, "sm_90a", tmp_path)
    monkeypatch.setenv(REQUIRE_PTXAS, "1")
    with pytest.raises(AssertionError, match="FLEXATTN_REQUIRE_PTXAS=1"):
        assert_ptxas_clean(ptx, "sm_90a", tmp_path)
