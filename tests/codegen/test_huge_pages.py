"""Packed weights in a huge-page buffer (codegen/cpu/huge_pages.py): the packed tensors move, the
params named as shared stay, the kernels give the same results on the copies, views keep their
memory, and the buffer is advised MADV_HUGEPAGE where the OS offers transparent huge pages."""
import mmap

import pytest
import torch

from deepfuse.codegen.cpu.huge_pages import huge_page_buffer, into_huge_pages
from deepfuse.codegen.cpu.kernels import PanelWeight
from deepfuse.codegen.cpu.w8a8_kernels import W8A8Weights, w8a8_linear

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="MADV_HUGEPAGE is Linux's")


def thp_mode() -> str:
    """always, madvise or never (the bracketed word of the sysfs file), '' where there is none."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return ""
    return text.split("[")[1].split("]")[0] if "[" in text else ""


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            fields[head.rstrip(":")] = line.split()[1]
    return fields


def test_the_buffer_is_2mib_aligned_and_advised_for_huge_pages_or_not():
    buf, small = huge_page_buffer(3 << 20), huge_page_buffer(3 << 20, huge=False)
    for b in (buf, small):
        assert b.dtype == torch.uint8 and b.numel() == 3 << 20 and b.data_ptr() % (2 << 20) == 0
        b.fill_(7)
        assert int(b.sum()) == 7 * (3 << 20)
    if thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {thp_mode() or 'absent'} on this machine")
    assert mapping_of(buf.data_ptr()).get("THPeligible") == "1"
    assert mapping_of(small.data_ptr()).get("THPeligible") == "0"


def test_packed_tensors_move_shared_params_stay_and_results_are_unchanged(native):
    if not native.i8_gemm_available():
        pytest.skip("this CPU has no AVX512-VNNI")
    g = torch.Generator().manual_seed(0)
    wq = torch.randint(0, 256, (400, 512), dtype=torch.uint8, generator=g)
    w8 = W8A8Weights(torch.float32, wq, torch.rand(400, generator=g) / 100)
    panel = PanelWeight(torch.randn(160, 512, generator=g), native)
    x = torch.randn(3, 512, generator=g)
    xp = torch.randn(3, 512, generator=g)
    before = w8a8_linear(x, w8, 32), panel(xp)
    old = w8.panels.data_ptr(), panel.panels.data_ptr()
    view = w8.panels[:1]  # a view of a moved tensor keeps the old memory (and its values)
    objects, moved = into_huge_pages([w8, panel], keep={wq.data_ptr()})
    assert objects[0] is w8 and objects[1] is panel
    assert moved >= w8.panels.nbytes + panel.panels.nbytes
    assert (w8.panels.data_ptr(), panel.panels.data_ptr()) != old
    assert w8.wq.data_ptr() == wq.data_ptr()  # a shared param stays where it is
    assert view.data_ptr() == old[0]
    assert torch.equal(w8a8_linear(x, w8, 32), before[0]) and torch.equal(panel(xp), before[1])


def test_tensors_in_tuples_and_bare_tensors_move_small_ones_stay():
    big, small = torch.arange(1 << 16, dtype=torch.int32), torch.arange(10.0)
    objects, moved = into_huge_pages([big, (big, small)], keep=set())
    assert moved == big.nbytes
    assert torch.equal(objects[0], big) and objects[0].data_ptr() != big.data_ptr()
    assert objects[1][0].data_ptr() == objects[0].data_ptr() and objects[1][1] is small
    assert objects[0].data_ptr() % 64 == 0
    assert into_huge_pages([small], keep=set()) == ([small], 0)
