"""Can a cupy.RawModule target sm_90a (Hopper's wgmma and TMA)? Compiles one kernel per way and runs it.

    python3 tools/sm90a_probe.py

The kernel executes ``wgmma.fence`` (an sm_90a instruction, one warpgroup of 128
threads) only where ``__CUDA_ARCH_FEAT_SM90_ALL`` is defined, and writes 90 there,
-1 elsewhere. Each way runs in its own process, since an instruction the GPU rejects
would end the CUDA context. Prints, per backend and options, what the kernel wrote or
why it did not compile.
"""

import subprocess
import sys

CODE = r'''
extern "C" __global__ void probe(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    if (threadIdx.x == 0) out[0] = 90;
#else
    if (threadIdx.x == 0) out[0] = -1;
#endif
}
'''
WAYS = [(backend, options) for options in ((), ("-arch=sm_90a",), ("-arch=compute_90a",))
        for backend in ("nvrtc", "nvcc")]


def one(index):
    import cupy
    backend, options = WAYS[index]
    try:
        module = cupy.RawModule(code=CODE, options=options, backend=backend)
        out = cupy.zeros(1, cupy.int32)
        module.get_function("probe")((1,), (128,), (out,))
        result = int(out[0])
    except Exception as exc:  # a compiler's refusal is the answer for this way
        result = f"not compiled: {type(exc).__name__}"
    print(f"{backend:5s} options={options!s:24s} -> {result}")


def main():
    for i in range(len(WAYS)):
        subprocess.run([sys.executable, __file__, str(i)], check=False)


if __name__ == "__main__":
    one(int(sys.argv[1])) if len(sys.argv) > 1 else main()
