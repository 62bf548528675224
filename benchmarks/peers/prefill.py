#!/usr/bin/env python3
"""pagedrt's prefill beside FlashInfer's (FA3 and FA2 backends) and cuDNN's, on the same arrays, in one process.

    python3 benchmarks/peers/prefill.py [--cases p1,p16,chunk,var,mixed] [--peers fa3,fa3:nhd,fa2,cudnn]
                                        [--rounds 3] [--repeats 20] [--out FILE]

The standard prefill cases of ../shared/WORKLOADS.md, built by ``pagedrt.bench.prefill.case_arrays`` (fp16, 32
query heads over 8 KV heads x 128, block 16, block ids a seeded random permutation, causal aligned bottom-right).
FlashInfer reads pagedrt's planes in place, which are its HND layout ([blocks, KV heads, block size, head_dim]),
or a copy in its NHD layout (``fa3:nhd``); the block table becomes its page indices. cuDNN (PyTorch's
scaled_dot_product_attention restricted to the cuDNN backend) runs where every sequence has the same length and
no prefix (p1, p16), over contiguous K/V.

Prefill is bound by its MMAs, and these GPUs lower their SM clock within a few hundred milliseconds of such load
(docs/KERNELS.md, "The clock"), so a figure depends on what ran before it. Here the kernels take turns: each round
times every kernel once (the median of ``--repeats`` calls, L2 flushed before each, ``pagedrt.bench.harness.Timer``),
each round in a different order, and reads the SM clock after each. Printed per case and kernel: the median over
rounds, TFLOP/s as WORKLOADS.md counts them, the clock's range, pagedrt's time over the kernel's in each round
(above 1: pagedrt slower), and the kernel's largest difference from pagedrt's output.

Needs PyTorch, CuPy and FlashInfer 0.5.0 with apache-tvm-ffi 0.1.2, which compiles its kernels on first use (about
a minute each, with nvcc; ``FLASHINFER_CUDA_ARCH_LIST`` defaults to 9.0a here). For a machine without a network,
fetch the two wheels elsewhere (``pip download --no-deps --only-binary=:all: --python-version 3.12 -d WHEELS
flashinfer-python==0.5.0 apache-tvm-ffi==0.1.2``), then there ``pip install --no-index --no-deps --target DIR
WHEELS/*.whl`` and put DIR on PYTHONPATH. A peer that fails to build or run is reported and left out; pagedrt's
runtime never imports this file.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")

from pagedrt.bench import harness  # noqa: E402
from pagedrt.bench.cases import BLOCK_SIZE, HEAD_DIM, KV_HEADS, PREFILL_CASES, Q_HEADS  # noqa: E402
from pagedrt.bench.prefill import case_arrays  # noqa: E402

PEERS = ("fa3", "fa3:nhd", "fa2", "fa2:nhd", "cudnn")


def pagedrt_call(cp, a, new):
    """(call, output) of pagedrt's plan over the case's paged planes."""
    from pagedrt import attention
    q, (k, v) = a["q"], a["planes"][0]
    plan = attention.PrefillPlan(q, k, a["tables"][0], a["lens"], a["d_qo"], query_lens=np.asarray(new),
                                 validate=False)
    out = cp.empty_like(q)
    return (lambda: plan.run(q, k, v, out)), out


def flashinfer_call(torch, a, peer, workspace):
    """(call, output) of FlashInfer's paged prefill wrapper. ``peer``: its backend (``fa3``, ``fa2``) over the
    same planes (HND pages), or ``BACKEND:nhd`` over a copy of them in NHD pages ([blocks, block size, KV heads,
    head_dim])."""
    import flashinfer
    backend, _, layout = peer.partition(":")
    q = torch.from_dlpack(a["q"])
    k, v = (torch.from_dlpack(plane) for plane in a["planes"][0])
    if layout == "nhd":
        k, v = (p.permute(0, 2, 1, 3).contiguous() for p in (k, v))
    blocks = a["blocks"]
    table = torch.from_dlpack(a["tables"][0])
    indices = torch.cat([table[b, :int(n)] for b, n in enumerate(blocks)]).contiguous()
    kv_indptr = torch.tensor(np.concatenate(([0], np.cumsum(blocks))), dtype=torch.int32, device="cuda")
    qo_indptr = torch.tensor(a["qo"], dtype=torch.int32, device="cuda")
    lens = torch.from_dlpack(a["lens"])
    last = (lens - (torch.tensor(blocks, dtype=torch.int32, device="cuda") - 1) * BLOCK_SIZE).to(torch.int32)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, layout.upper() or "HND", backend=backend)
    wrapper.plan(qo_indptr, kv_indptr, indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, causal=True,
                 q_data_type=torch.float16, kv_data_type=torch.float16)
    out = torch.empty_like(q)
    return (lambda: wrapper.run(q, (k, v), out=out)), out


def cudnn_call(torch, a, new):
    """(call, output as [tokens, heads, head_dim]) of cuDNN's attention over contiguous K/V, or None where the
    case's sequences differ in length or have a prefix."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    n = int(new[0])
    if any(int(x) != n for x in new) or int(a["qo"][-1]) != int(a["lens"].sum()):
        return None
    batch = len(new)
    q = torch.from_dlpack(a["q"]).view(batch, n, Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    table = torch.from_dlpack(a["tables"][0]).long()
    kv = []
    for plane in a["planes"][0]:
        p = torch.from_dlpack(plane)[table]  # [batch, blocks, KV heads, block, head_dim]
        p = p.permute(0, 2, 1, 3, 4).reshape(batch, KV_HEADS, n, HEAD_DIM)
        kv.append(p.repeat_interleave(Q_HEADS // KV_HEADS, dim=1).contiguous())
    holder = {}

    def call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            holder["out"] = F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True)

    call()
    torch.cuda.synchronize()
    return call, lambda: holder["out"].transpose(1, 2).reshape(batch * n, Q_HEADS, HEAD_DIM)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="p1,p16,chunk,var,mixed", help="comma-separated standard prefill cases")
    ap.add_argument("--peers", default="fa3,fa3:nhd,fa2,cudnn",
                    help="of fa3, fa2 (FlashInfer's backends over HND pages; BACKEND:nhd over NHD pages), cudnn")
    ap.add_argument("--rounds", type=int, default=3, help="turns of every kernel, each round in another order")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per kernel a round (their median)")
    ap.add_argument("--out", help="write the rows as JSON")
    args = ap.parse_args(argv)
    names = harness.case_names(ap, args.cases, PREFILL_CASES)
    peers = list(dict.fromkeys(args.peers.split(",")))  # each once
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peers {unknown}: each one of {', '.join(PEERS)}")
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be at least 1")
    import cupy as cp
    import torch
    info, timer = harness.device_info(cp), harness.Timer(cp)
    print(harness.header(info, None))
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for name in names:
        case = PREFILL_CASES[name]
        new = case.new
        a = case_arrays(cp, case)
        flops = case.flops
        calls = {"pagedrt": pagedrt_call(cp, a, new)}
        for peer in peers:
            t0 = time.perf_counter()
            try:
                made = cudnn_call(torch, a, new) if peer == "cudnn" else flashinfer_call(torch, a, peer, workspace)
                if made is None:
                    continue
                made[0]()
                torch.cuda.synchronize()
                calls[peer] = made
                print(f"{name}: {peer} ready in {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as e:  # a peer that cannot build or run is left out, with the reason
                print(f"{name}: {peer} left out: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                traceback.print_exc(limit=2, file=sys.stdout)
        calls["pagedrt"][0]()
        cp.cuda.Device().synchronize()
        ours = calls["pagedrt"][1].astype(np.float32)
        scale = float(cp.abs(ours).max())
        times = {k: [] for k in calls}
        mhz = {k: [] for k in calls}
        order = list(calls)
        for r in range(args.rounds):
            turn = order[r % len(order):] + order[:r % len(order)]
            for k in turn:
                times[k].append(timer.gpu_us(calls[k][0], args.repeats, flush_l2=True))
                mhz[k].append(timer.sm_mhz())
        for k in calls:
            out = calls[k][1]
            out = out() if callable(out) else out
            diff = float(cp.abs(cp.asarray(out).astype(np.float32) - ours).max()) / scale if k != "pagedrt" else 0.0
            us = statistics.median(times[k])
            ratio = [p / t for p, t in zip(times["pagedrt"], times[k])]
            rows.append({"case": name, "kernel": k, "us": us, "tflops": flops / (us * 1e-6) / 1e12,
                         "rounds_us": times[k], "sm_mhz": mhz[k], "pagedrt_over": ratio, "max_diff": diff})
        del a, calls
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()
    print(f"{'case':6} {'kernel':8} {'us':>9} {'TFLOP/s':>8} {'SM MHz':>10} {'pagedrt/it':>16} {'max diff':>9}")
    for r in rows:
        lo, hi = min(r["pagedrt_over"]), max(r["pagedrt_over"])
        print(f"{r['case']:6} {r['kernel']:8} {r['us']:9.1f} {r['tflops']:8.1f} "
              f"{min(r['sm_mhz']):4.0f}-{max(r['sm_mhz']):4.0f} {lo:7.3f}-{hi:7.3f}  {r['max_diff']:9.2e}")
    print("us: median over rounds of each round's median (L2 flushed); pagedrt/it: pagedrt's time over the "
          "kernel's, per round; max diff: largest |difference| from pagedrt's output over pagedrt's largest |output|")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": info, "argv": sys.argv, "rows": rows}, indent=1,
                                             default=str))


if __name__ == "__main__":
    main()
