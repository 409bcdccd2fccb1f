import pytest

from kvpool.budget import GiB, Device, export_budget, host_memory_available

MiB = 1 << 20


def test_cpu_bounded_by_pool_capacity():
    budget = export_budget(Device(), 2 * GiB, 20 * GiB, cell_price=1000)
    assert budget.bytes == 2 * GiB
    assert budget.cells == 2 * GiB // 1000
    assert "capacity" in budget.reason


def test_cpu_bounded_by_cap():
    budget = export_budget(Device(), 64 * GiB, 100 * GiB)
    assert budget.bytes == 8 * GiB
    assert budget.cells is None
    assert "cap" in budget.reason


def test_cpu_bounded_by_host_memory_beyond_headroom():
    budget = export_budget(Device(), 16 * GiB, 5 * GiB, headroom=1 * GiB)
    assert budget.bytes == 4 * GiB
    assert "host memory" in budget.reason


def test_cpu_host_below_headroom_grants_nothing():
    assert export_budget(Device(), 16 * GiB, 512 * MiB).bytes == 0


def test_device_bounded_by_its_free_memory():
    gpu = Device("cuda", "cuda:0", free_bytes=3 * GiB)
    budget = export_budget(gpu, 16 * GiB, 20 * GiB, headroom=1 * GiB, cell_price=4096)
    assert budget.bytes == 2 * GiB
    assert budget.cells == 2 * GiB // 4096
    assert "cuda:0" in budget.reason


def test_device_with_plenty_still_bounded_by_host_rules():
    gpu = Device("cuda", "cuda:0", free_bytes=80 * GiB)
    assert export_budget(gpu, 4 * GiB, 20 * GiB).bytes == 4 * GiB


@pytest.mark.parametrize("free", [0, None])
def test_device_reporting_no_free_memory_grants_nothing(free):
    budget = export_budget(Device("metal", "apple-gpu", free_bytes=free), 4 * GiB, 20 * GiB,
                           headroom=2 * GiB, cell_price=100)
    assert budget.bytes == 0 and budget.cells == 0
    assert "no free memory" in budget.reason and "2.00 GiB" in budget.reason


def test_bad_arguments():
    with pytest.raises(ValueError):
        export_budget(Device(), -1, 0)
    with pytest.raises(ValueError):
        export_budget(Device(), 1, 1, cell_price=0)


def test_host_memory_available_reads_meminfo():
    assert host_memory_available() > 0
