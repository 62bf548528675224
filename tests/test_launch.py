"""The launch path's host parts (pagedrt.kernels.launch): kernel parameters packed for cuLaunchKernelEx, named
errors for what it cannot pack, and plain launches outside ``dependent_launches`` (no GPU needed)."""

import ctypes

import numpy as np
import pytest

from pagedrt.errors import LaunchArgumentError
from pagedrt.kernels import launch


def test_kernel_params_point_at_each_value_in_its_dtype():
    args = (np.uint64(0xDEADBEEF000), np.int64(-5), np.int32(7), np.uint32(9), np.float32(0.5))
    address, keep = launch.kernel_params(args)
    pointers = (ctypes.c_void_p * len(args)).from_address(address)
    kinds = (ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float)
    got = [kind.from_address(p).value for kind, p in zip(kinds, pointers)]
    assert got == [0xDEADBEEF000, -5, 7, 9, 0.5]
    assert len(keep[0]) == len(args)


@pytest.mark.parametrize("bad", [5, 1.5, np.float64(1.0), np.zeros(2, np.int32)], ids=repr)
def test_kernel_params_refuse_what_has_no_fixed_c_type(bad):
    with pytest.raises(LaunchArgumentError, match="kernel argument 1 is"):
        launch.kernel_params((np.int32(1), bad))


def test_outside_dependent_launches_a_launch_is_cupys():
    calls = []

    def kernel(grid, block, args, shared_mem=0):
        calls.append((grid, block, args, shared_mem))

    assert not launch.programmatic()
    launch.launch(kernel, (2, 3, 4), (128,), (np.int32(1),), 4096)
    assert calls == [((2, 3, 4), (128,), (np.int32(1),), 4096)]
