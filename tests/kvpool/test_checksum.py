import numpy as np
import pytest

from kvpool import checksum


@pytest.mark.parametrize("nbytes", [1000, 3 << 20, 24 << 20])  # chunked, chunked, helper thread
def test_checksum_covers_the_source_in_order_whatever_the_path(nbytes):
    src = np.random.default_rng(0).integers(0, 255, (4, nbytes // 4), dtype=np.uint8)
    dst = np.zeros_like(src)
    found, copied = checksum.copy_checksummed([(dst[:2], src[:2]), (dst[2:], src[2:])])
    assert copied == src.nbytes and np.array_equal(dst, src)
    assert found == checksum.digest([src])


def test_strided_source_into_contiguous_destination():
    full = np.random.default_rng(1).standard_normal((3, 40, 8)).astype(np.float32)
    src = full[:, :25]  # a live view of a buffer with room to grow: not contiguous
    dst = np.empty((3, 25, 8), np.float32)
    found, _ = checksum.copy_checksummed([(dst, src)])
    assert np.array_equal(dst, src) and found == checksum.digest([np.ascontiguousarray(src)])


def test_contiguous_source_into_strided_destination():
    src = np.arange(3 * 25 * 8, dtype=np.float32).reshape(3, 25, 8)
    buffer = np.zeros((3, 40, 8), np.float32)
    found, _ = checksum.copy_checksummed([(buffer[:, :25], src)])
    assert np.array_equal(buffer[:, :25], src) and found == checksum.digest([src])


def test_mismatched_pairs_are_refused():
    with pytest.raises(ValueError, match="shape mismatch"):
        checksum.copy_checksummed([(np.zeros(4, np.uint8), np.zeros(5, np.uint8))])
    with pytest.raises(ValueError, match="shape mismatch"):
        checksum.copy_checksummed([(np.zeros(4, np.float32), np.zeros(4, np.int32))])
