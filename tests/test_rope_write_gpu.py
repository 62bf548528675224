"""The rotary embeddings + K/V write kernel (cuda_src/rope_write.cu) on the device against a float64 rotation computed
apart (needs a GPU; skipped otherwise): fp16, bf16 and FP8 planes, both placements, padding slots, one token and a
few hundred, head dims 64 and 128; the device's checks, with nothing written; under programmatic dependent launch
and in a CUDA graph."""

import numpy as np
import pytest

from helpers import compile_all, to_host
from rope_cases import Problem
from pagedrt.engine import rope_write
from pagedrt.engine.rope_write import RopeWritePlan
from pagedrt.errors import BlockTableError, LaunchArgumentError
from pagedrt.kernels import configs, validate

pytestmark = pytest.mark.gpu

DTYPES = [("float16", False), ("bfloat16", False), ("float16", True), ("bfloat16", True)]
SHAPES = {"one token": dict(query_lens=(1,), cached=(40,)),
          "ragged": dict(query_lens=(1, 5, 300), cached=(700, 0, 2))}
STEP_ARRAYS = ("qkv", "slots", "qo_indptr", "seq_lens", "inv_freq")


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every kernel of this module, compiled up front."""
    cfgs = [configs.Config(d, h, 16, 1, configs.FP8 if fp8 else None) for d, fp8 in DTYPES for h in (64, 128)]
    compile_all(rope_write.instances(cfgs + [configs.Config("float16", 128, 128, 1)]), validate.instances())


class OnDevice:
    """A Problem's arrays on the device, and its plan (over the K plane of ``plan_layer``, default its own)."""

    def __init__(self, p, plan_layer=None, **plan_kw):
        import cupy
        self.p, self.buffer, self.q = p, cupy.asarray(p.buffer), cupy.asarray(p.q)
        self.step = {name: cupy.asarray(getattr(p, name)) for name in STEP_ARRAYS}
        s = self.step
        self.plan = RopeWritePlan(s["qkv"], self.q, p.planes(self.buffer, plan_layer)[0], s["slots"],
                                  s["qo_indptr"], s["seq_lens"], s["inv_freq"], **plan_kw)

    def run(self):
        import cupy
        k, v = self.p.planes(self.buffer)
        self.plan.run(self.step["qkv"], self.q, k, v, **self.p.scale_keywords(cupy))

    def check(self):
        self.p.check(to_host(self.q), to_host(self.buffer))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("placement", ["plane", "block"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype, fp8_planes", DTYPES)
def test_kernel_turns_q_and_k_and_writes_only_live_slots(dtype, fp8_planes, head_dim, placement, shape):
    dev = OnDevice(Problem(dtype, fp8_planes, head_dim, placement=placement, **SHAPES[shape]))
    dev.run()
    dev.check()


def test_kernel_at_block_size_128_through_a_plan_over_another_layer():
    dev = OnDevice(Problem("float16", block_size=128, placement="block", layers=3, layer=2), plan_layer=0)
    dev.run()
    dev.check()  # layer 2 written, layers 0 and 1 still poison


def test_fp8_bytes_equal_the_host_paths():
    """FP8 bytes from the device and from the host reference: one rule (pagedrt.fp8), so v's are the same bits and
    k's differ only where the float32 and float64 rotations round k to different float16 values (rare)."""
    p = Problem("float16", True, **SHAPES["ragged"])
    dev = OnDevice(p)
    dev.run()
    host_k, host_v = p.planes(p.buffer)
    RopeWritePlan(p.qkv, p.q, host_k, p.slots, p.qo_indptr, p.seq_lens, p.inv_freq).run(
        p.qkv, p.q, host_k, host_v, **p.scale_keywords())
    k, v = (to_host(a) for a in p.planes(dev.buffer))
    assert np.array_equal(v, host_v)  # v is not rotated: the same bits
    blocks, offsets = np.divmod(p.slots[p.slots >= 0], p.block_size)
    assert np.mean(k[blocks, :, offsets] != host_k[blocks, :, offsets]) < 0.01  # of the bytes written


def test_device_checks_refuse_bad_slots_and_arrays_and_write_nothing():
    import cupy
    p = Problem("float16")
    dev = OnDevice(p)
    before = to_host(dev.buffer)
    bad = dev.step["slots"].copy()
    bad[3] = 10 ** 6
    with pytest.raises(BlockTableError, match=r"slot_mapping\[3\] = 1000000"):
        RopeWritePlan(dev.step["qkv"], dev.q, p.planes(dev.buffer)[0], bad, dev.step["qo_indptr"],
                      dev.step["seq_lens"], dev.step["inv_freq"])
    with pytest.raises(LaunchArgumentError, match="mix NumPy"):
        RopeWritePlan(p.qkv, dev.q, p.planes(dev.buffer)[0], dev.step["slots"], dev.step["qo_indptr"],
                      dev.step["seq_lens"], dev.step["inv_freq"])
    k, v = p.planes(dev.buffer)
    misaligned = cupy.empty(dev.q.size + 1, np.float16)[1:].reshape(dev.q.shape)
    with pytest.raises(LaunchArgumentError, match="16-byte"):
        dev.plan.run(dev.step["qkv"], misaligned, k, v)
    assert np.array_equal(to_host(dev.buffer), before, equal_nan=True)


def test_pdl_launch_waits_for_the_kernel_that_wrote_qkv():
    import cupy
    from pagedrt.kernels.launch import dependent_launches
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    p = Problem("bfloat16", True, **SHAPES["ragged"])
    dev = OnDevice(p)
    dev.step["qkv"].fill(0)
    with dependent_launches():
        dev.step["qkv"][...] = cupy.asarray(p.qkv)  # a plain launch the plan's waits for
        dev.run()
    dev.check()


def test_plan_captured_in_a_graph_reads_each_replays_qkv():
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        p = Problem("float16", **SHAPES["ragged"])
        dev = OnDevice(p)
        dev.run()  # warm
        stream.begin_capture()
        dev.run()
        graph = stream.end_capture()
        p.qkv[...] = np.random.default_rng(5).standard_normal(p.qkv.shape).astype(p.qkv.dtype)
        dev.step["qkv"][...] = cupy.asarray(p.qkv)
        dev.buffer[...] = cupy.asarray(p.buffer)  # poison again
        graph.launch(stream)
        stream.synchronize()
    dev.check()
