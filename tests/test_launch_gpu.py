"""Programmatic dependent launch on the device (needs a GPU of compute capability 9.0 or later; skipped
otherwise): a step of K/V writes and decode attention over several layers, launched through
``cuLaunchKernelEx`` with programmatic stream serialization, gives the plain launches' output bit for bit and
the float64 reference's within tolerance, and captures into a CUDA graph that replays it.

Every output is poisoned with NaN before a step; slots a kernel must not read hold NaN (kernel_cases.Case, its
one layer copied, scaled, to the others).
"""

import numpy as np
import pytest

from helpers import to_host
from kernel_cases import Case, rel_error
from pagedrt import source
from pagedrt.attention import DecodePlan, decode, reference
from pagedrt.kernels import WritePlan, write, write_kv_reference
from pagedrt.kernels.configs import BASE, Config
from pagedrt.kernels.launch import dependent_launches, launch_ex, programmatic

pytestmark = pytest.mark.gpu

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
CONFIGS = [BASE, Config("bfloat16", 128, 16, 4), Config("float32", 128, 16, 4), Config("float16", 64, 16, 8)]
LAYERS = 3


@pytest.fixture(scope="module", autouse=True)
def compiled():
    import cupy
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    for part in (decode.instances(CONFIGS, paged=(True,)), write.instances(CONFIGS)):
        for file, listed in part.items():
            source.preload(file, listed)


class Step:
    """A Case over LAYERS layers: per layer the newest token of every sequence written, then attention."""

    def __init__(self, cfg, lens, seed, **plan_kw):
        import cupy
        self.case = Case(cfg, lens, layers=LAYERS, seed=seed)
        buffer = self.case.buffer  # Case fills one layer: the others get scaled copies of it (NaN where it has NaN)
        for layer in range(LAYERS):
            buffer[:, :, layer] = (buffer[:, :, 1].astype(np.float32) * (0.5 + 0.25 * layer)).astype(buffer.dtype)
        rng = np.random.default_rng(seed + 100)
        shape = (LAYERS, len(lens)) + self.case.q.shape[1:]
        dt = self.case.q.dtype
        self.q = rng.standard_normal(shape, dtype=np.float32).astype(dt)
        kv_shape = (2, LAYERS, len(lens), self.case.k.shape[1], cfg.head_dim)
        self.new = rng.standard_normal(kv_shape, dtype=np.float32).astype(dt)
        last = self.case.lens.astype(np.int64) - 1
        blocks = self.case.table[np.arange(len(lens)), last // cfg.block_size].astype(np.int64)
        self.slots = blocks * cfg.block_size + last % cfg.block_size
        self.buffer = cupy.asarray(self.case.buffer)
        self.dq, self.dnew = cupy.asarray(self.q), cupy.asarray(self.new)
        self.table, self.lens = cupy.asarray(self.case.table), cupy.asarray(self.case.lens)
        self.plan = DecodePlan(self.dq[0], self.plane(0, 0), self.table, self.lens, **plan_kw)
        self.writer = WritePlan(self.dnew[0, 0], self.plane(0, 0), cupy.asarray(self.slots))
        self.out = cupy.empty_like(self.dq)

    def plane(self, kv, layer):
        return self.buffer[:, kv, layer]

    def __call__(self):
        for layer in range(LAYERS):
            k, v = self.plane(0, layer), self.plane(1, layer)
            self.writer.run(self.dnew[0, layer], self.dnew[1, layer], k, v)
            self.plan.run(self.dq[layer], k, v, self.out[layer])

    def poison(self):
        import cupy
        self.out[...] = cupy.asarray(np.full(self.q.shape, np.nan, np.float32).astype(self.q.dtype))

    def expected(self):
        """The float64 reference of every layer, after the step's writes (applied to a host copy)."""
        buffer = self.case.buffer.copy()
        refs = []
        for layer in range(LAYERS):
            k, v = buffer[:, 0, layer], buffer[:, 1, layer]
            write_kv_reference(self.new[0, layer], self.new[1, layer], k, v, self.slots)
            refs.append(reference.paged_decode(self.q[layer].astype(np.float64), k, v, self.case.table,
                                               self.case.lens))
        return np.stack(refs)


def run(step, pdl):
    step.poison()
    if pdl:
        with dependent_launches():
            assert programmatic()
            step()
    else:
        step()
    return to_host(step.out)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("plan_kw", [{}, {"num_splits": 3}, {"num_splits": 7, "geometry": "short"}],
                         ids=["planned", "split3", "split7-short"])
def test_pdl_step_equals_plain_launches_and_the_reference(cfg, plan_kw):
    step = Step(cfg, [1, 15, 16, 17, 700, 2100], seed=CONFIGS.index(cfg), **plan_kw)
    plain = run(step, pdl=False)
    assert not programmatic()
    pdl = run(step, pdl=True)
    assert np.array_equal(pdl.view(np.uint8), plain.view(np.uint8))
    assert rel_error(pdl, step.expected()) <= TOLERANCE[cfg.dtype]


def test_pdl_step_captures_into_a_graph_that_replays_it():
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step = Step(BASE, [3000, 5, 900, 64], seed=7, num_splits=4)  # split: the workspace is shared by layers
        plain = run(step, pdl=False)
        with dependent_launches():
            step()  # warm
            stream.synchronize()
            stream.begin_capture()
            step()
            graph = stream.end_capture()
        for _ in range(3):
            step.poison()
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(to_host(step.out).view(np.uint8), plain.view(np.uint8))
    assert rel_error(plain, step.expected()) <= TOLERANCE["float16"]


def test_each_attention_reads_the_token_its_write_just_stored():
    """Fresh new tokens every step: an attention that read before the write ahead of it had finished would see
    the previous step's token and miss the reference."""
    import cupy
    step = Step(BASE, [4096] * 2 + [17], seed=3)
    rng = np.random.default_rng(11)
    for _ in range(4):
        step.new = rng.standard_normal(step.new.shape, dtype=np.float32).astype(step.new.dtype)
        step.dnew[...] = cupy.asarray(step.new)
        assert rel_error(run(step, pdl=True), step.expected()) <= TOLERANCE["float16"]


def test_launch_ex_without_the_attribute_launches_normally():
    import cupy
    from pagedrt.kernels.args import ptr
    case = Case(BASE, [40], seed=5)
    buffer = cupy.asarray(case.buffer)
    k, v = buffer[:, 0, 1], buffer[:, 1, 1]
    new = cupy.asarray(np.ones((1,) + case.k.shape[1:2] + (BASE.head_dim,), np.float16))
    slots = cupy.asarray(np.array([int(case.table[0, 0]) * BASE.block_size], np.int64))
    fn = source.function(write.FILE, write.kernel_name(BASE))
    args = (ptr(new), ptr(new), ptr(k), ptr(v), np.int64(k.strides[0] // 2), ptr(slots), np.int64(1),
            np.int32(k.shape[1]))
    launch_ex(fn, (1,), (write.THREADS,), args, programmatic_serialization=False)
    got = to_host(k[int(case.table[0, 0]), :, 0])
    assert (got == 1).all()
