"""The K/V write and block copy kernels on the device against their references (needs a GPU; skipped
otherwise). Attention: test_attention_gpu.py.

Every input is fresh random data; every slot a kernel must not touch holds NaN (see
kernel_cases.Case). All the kernels the module needs are compiled up front in one
NVRTC call per source file.
"""

import numpy as np
import pytest

from helpers import to_host
from kernel_cases import (Case, Reproducer, check_closed_cache_refuses_writes, check_stale_slots_refused,  # noqa: F401
                          np_dtype)
from pagedrt import source
from pagedrt.errors import BlockTableError, LaunchArgumentError
from pagedrt.kernels import WritePlan, copy, copy_blocks, copy_blocks_reference, release_buffers, validate, write, \
    write_kv, write_kv_reference
from pagedrt.kernels import configs
from pagedrt.kernels.configs import BASE, Config

pytestmark = pytest.mark.gpu

WRITES = list(dict.fromkeys([Config(d, 128, 16, 1) for d in configs.CUDA_TYPES]
                            + [Config("float16", 80, 16, 1), Config("float16", 128, 8, 1),
                               Config("float16", 128, 128, 1)]))


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every kernel of this module, compiled up front: one NVRTC call per source file."""
    for part in (write.instances(WRITES), copy.instances(), validate.instances()):
        for file, listed in part.items():
            source.preload(file, listed)


class OnDevice:
    """A Case's K/V planes on the device: views of the uploaded block-major buffer."""

    def __init__(self, case, layer=1):
        import cupy
        self.buffer = cupy.asarray(case.buffer)
        self.k, self.v = self.buffer[:, 0, layer], self.buffer[:, 1, layer]


def test_device_only_argument_checks():
    import cupy
    case = Case(BASE, [5], seed=1)
    dev = OnDevice(case)
    with pytest.raises(LaunchArgumentError, match="mix NumPy"):
        write_kv(case.q[:, :2], case.q[:, :2], dev.k, dev.v, cupy.zeros(1, np.int64))
    shifted = cupy.empty(2 * 128 + 8, np.float16)[8:].reshape(1, 2, 128)  # 16 bytes in: aligned
    misaligned = cupy.empty(2 * 128 + 1, np.float16)[1:].reshape(1, 2, 128)
    write_kv(shifted, shifted, dev.k, dev.v, cupy.full(1, -1, np.int64))
    with pytest.raises(LaunchArgumentError, match="16-byte"):
        write_kv(misaligned, misaligned, dev.k, dev.v, cupy.full(1, -1, np.int64))


# --- write and copy --------------------------------------------------------------------------

def same_bits(a, b):
    a, b = to_host(a), to_host(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("cfg", WRITES, ids=str)
@pytest.mark.parametrize("shape", ["prompt", "decode"])
def test_write_kv_matches_the_reference_and_skips_padding(cfg, shape):
    import cupy
    rng = np.random.default_rng(4)
    bs = cfg.block_size
    case = Case(cfg, [1], kv_heads=2, spare_blocks=(4096 // bs) + 300)
    num_blocks = len(case.k)
    if shape == "prompt":  # one 4096-token prompt into scattered blocks
        blocks = rng.permutation(num_blocks)[:4096 // bs]
        slots = (blocks[:, None] * bs + np.arange(bs)).reshape(-1).astype(np.int64)
    else:  # one token for each of 256 sequences
        slots = rng.permutation(num_blocks * bs)[:256].astype(np.int64)
    slots[rng.permutation(len(slots))[:len(slots) // 10]] = -1  # padding
    dt = np_dtype(cfg.dtype)
    k = rng.standard_normal((len(slots), 2, cfg.head_dim)).astype(dt)
    v = rng.standard_normal((len(slots), 2, cfg.head_dim)).astype(dt)
    dev = OnDevice(case)
    write_kv(cupy.asarray(k), cupy.asarray(v), dev.k, dev.v, cupy.asarray(slots))
    write_kv_reference(k, v, case.k, case.v, slots)
    assert same_bits(dev.buffer, case.buffer)
    with pytest.raises(BlockTableError, match="slot_mapping"):
        bad = slots.copy()
        bad[-1] = num_blocks * bs
        write_kv(cupy.asarray(k), cupy.asarray(v), dev.k, dev.v, cupy.asarray(bad))
    assert same_bits(dev.buffer, case.buffer)


def test_write_plan_runs_every_layer_like_the_reference():
    import cupy
    rng = np.random.default_rng(6)
    case = Case(BASE, [1], kv_heads=2, spare_blocks=300)
    slots = rng.permutation(len(case.k) * BASE.block_size)[:256].astype(np.int64)
    slots[::10] = -1
    new = [[rng.standard_normal((256, 2, BASE.head_dim)).astype(np.float16) for _ in range(2)] for _ in range(2)]
    dev = OnDevice(case)
    plan = WritePlan(cupy.asarray(new[0][0]), dev.buffer[:, 0, 0], cupy.asarray(slots))
    for layer, (k, v) in enumerate(new):
        plan.run(cupy.asarray(k), cupy.asarray(v), dev.buffer[:, 0, layer], dev.buffer[:, 1, layer])
        write_kv_reference(k, v, case.buffer[:, 0, layer], case.buffer[:, 1, layer], slots)
        assert same_bits(dev.buffer, case.buffer)


def test_copy_blocks_every_plane_in_one_launch():
    import cupy
    host = np.random.default_rng(8).standard_normal((64, 2, 3, 2, 16, 128)).astype(np.float16)
    dev = cupy.asarray(host)
    planes = lambda b: [b[:, kv, layer] for kv in range(2) for layer in range(3)]  # noqa: E731
    pairs = np.array([[1, 40], [2, 0], [1, 63], [5, 6]])
    copy_blocks(planes(dev), cupy.asarray(pairs))
    copy_blocks_reference(planes(host), pairs)
    assert same_bits(dev, host)
    with pytest.raises(BlockTableError, match=r"pairs\[1\]"):
        copy_blocks(planes(dev), [[3, 4], [5, 64]])
    assert same_bits(dev, host)


# --- blocks whose memory is not mapped, closed pools, duplicate slots ---------------------------
# Before these checks each refused call below ended in CUDA_ERROR_ILLEGAL_ADDRESS, which leaves the process's
# CUDA context unusable: every test checks that a kernel launched afterwards still runs and is right.

def test_write_and_copy_refuse_a_block_in_a_chunk_never_mapped_and_the_context_survives():
    import cupy
    r = Reproducer("cuda")
    slot = r.last * 16
    with pytest.raises(BlockTableError, match=rf"slot_mapping\[1\] = {slot} is in block {r.last}, .*not mapped"):
        write_kv(r.kv[:2], r.kv[:2], r.k, r.v, cupy.asarray([3, slot], dtype=np.int64))
    held = int(r.table[0, 0])
    with pytest.raises(BlockTableError, match=rf"pairs\[1\] = \({held}, {r.last}\) names block {r.last}, .*not mapped"):
        copy_blocks(r.cache.planes, cupy.asarray([[held, 5], [held, r.last]]))
    copy_blocks(r.cache.planes, cupy.asarray([[held, 5]]))
    assert same_bits(r.k[5], r.k[held])
    write_kv(r.kv, r.kv, r.k, r.v, r.slots)
    assert r.decode_is_right()
    cupy.cuda.Device().synchronize()


def test_write_refuses_slots_of_a_sequence_freed_and_trimmed():
    import cupy
    check_stale_slots_refused("cuda")
    cupy.cuda.Device().synchronize()


def test_planes_of_a_closed_cache_are_refused():
    import cupy
    check_closed_cache_refuses_writes("cuda")
    cupy.cuda.Device().synchronize()


def test_write_refuses_a_slot_given_twice_on_the_device():
    import cupy
    rng = np.random.default_rng(12)
    case = Case(BASE, [1], kv_heads=2, spare_blocks=600)
    dev = OnDevice(case)
    for n in (4, 5000):  # a few tokens; enough that the hash set sees collisions
        slots = rng.permutation(len(case.k) * BASE.block_size)[:n].astype(np.int64)
        slots[n // 2] = -1
        slots[n - 2], slots[1] = slots[1], -1  # token n-2 takes token 1's slot, then token 1 is padding
        slots[n - 1] = slots[n - 2]  # token n-1 repeats token n-2
        k = cupy.asarray(rng.standard_normal((n, 2, BASE.head_dim)).astype(np.float16))
        with pytest.raises(BlockTableError, match=rf"slot_mapping\[{n - 1}\] = {slots[n - 1]} repeats "
                                                  rf"slot_mapping\[{n - 2}\]") as info:
            write_kv(k, k, dev.k, dev.v, cupy.asarray(slots))
        assert (info.value.token, info.value.first_token) == (n - 1, n - 2)
        assert same_bits(dev.buffer, case.buffer)
        write_kv(k, k, dev.k, dev.v, cupy.asarray(slots), validate=False)  # the caller vouches: not checked
        slots[n - 1] = -1
        write_kv(k, k, dev.k, dev.v, cupy.asarray(slots))
        write_kv_reference(to_host(k), to_host(k), case.k, case.v, slots)
        assert same_bits(dev.buffer, case.buffer)


def test_release_buffers_drops_every_cached_device_buffer():
    r = Reproducer("cuda")  # its write cached a scratch buffer and the pool's chunk mask
    assert validate._scratch and r.cache.pool in validate._masks
    release_buffers()
    assert not validate._scratch and not len(validate._masks)
    assert r.decode_is_right()  # the next check makes new ones
