import numpy as np
import pytest

from kvpool import layout
from kvpool.errors import LayoutError
from kvpool.layout import ArrayTemplate, BlobLayout, KVArray


def test_plan_reserves_capacity_on_the_token_axis_aligned():
    plan, size = layout.plan([ArrayTemplate("k", "<f4", (2, 5, 3), 1), ArrayTemplate("s", "<f2", (7,))], 10)
    assert [(s.name, s.shape, s.offset) for s in plan.arrays] == [("k", (2, 10, 3), 0), ("s", (7,), 256)]
    assert size == 320


def test_live_runs_are_contiguous_and_canonical():
    plan, size = layout.plan([ArrayTemplate("k", "<f4", (2, 0, 3), 1)], 4)
    data = np.zeros(size, dtype=np.uint8)
    full = layout.full_view(data, plan.arrays[0])
    full[...] = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    runs = list(layout.live_runs(data, plan.arrays[0], 2))
    assert [r.flags.c_contiguous for r in runs] == [True, True]
    assert np.array_equal(np.concatenate([r.ravel() for r in runs]), [0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17])
    assert layout.live_nbytes(plan, 2) == 48


def test_checksum_order_does_not_depend_on_capacity():
    from kvpool import checksum

    src = np.random.default_rng(1).standard_normal((3, 5, 4)).astype(np.float32)
    digests = set()
    for capacity in (5, 9):
        plan, size = layout.plan([ArrayTemplate("k", "<f4", src.shape, 1)], capacity)
        data = np.zeros(size, dtype=np.uint8)
        for dst, part in layout.paired_runs(data, plan.arrays[0], 5, src):
            dst[...] = part
        digests.add(checksum.digest(layout.all_live_runs(data, plan, 5)))
    assert len(digests) == 1


@pytest.mark.parametrize("dtype", [object, ">f4", np.complex64, "U3"])
def test_unstorable_dtypes_are_refused(dtype):
    with pytest.raises(LayoutError, match="cannot be stored"):
        layout.plan([ArrayTemplate("x", dtype, (2,))], 1)


def test_bad_templates():
    with pytest.raises(LayoutError, match="token axis"):
        layout.plan([ArrayTemplate("x", "<f4", (2,), 3)], 1)
    with pytest.raises(LayoutError, match="named"):
        layout.plan([ArrayTemplate("x", "<f4", (2,)), ArrayTemplate("x", "<f4", (2,))], 1)
    with pytest.raises(LayoutError, match="disagree"):
        layout.live_tokens_of([KVArray("a", np.zeros((2, 3)), 1), KVArray("b", np.zeros((4,)), 0)])


def test_validate_refuses_arrays_outside_the_extent():
    plan, size = layout.plan([ArrayTemplate("k", "<f4", (2, 0, 3), 1)], 4)
    layout.validate(plan, size, 4, 4)
    with pytest.raises(LayoutError, match="past"):
        layout.validate(plan, size - 64, 4, 4)
    with pytest.raises(LayoutError, match="capacity"):
        layout.validate(plan, size, 4, 5)
    with pytest.raises(LayoutError, match="cells"):
        layout.validate(plan, size, 5, 5)
    with pytest.raises(LayoutError):
        layout.validate(BlobLayout(100), 64, 1, 1)


def test_layout_record_round_trip_and_garbage():
    plan, _ = layout.plan([ArrayTemplate("k", "<f2", (1, 2, 3), 1)], 2)
    assert layout.decode_layout(layout.encode_layout(plan)) == plan
    assert layout.decode_layout(layout.encode_layout(BlobLayout(5))) == BlobLayout(5)
    with pytest.raises(LayoutError):
        layout.decode_layout(b"\x92\xa5bogus\x01")
