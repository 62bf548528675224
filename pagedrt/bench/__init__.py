"""Benchmarks of the runtime, each a module run as ``python3 -m pagedrt.bench.<name>`` (``--help`` for its options).

- ``decode``: decode attention on the standard workloads against the measured bandwidth ceilings;
- ``launch``: host time per launch, the launchers against CuPy's own launch;
- ``layers``: a 32-layer decode step, plane- vs block-major, Python launches vs a plan vs a CUDA graph;
- ``pool``: what a pool grow costs, by chunk size, and copy bandwidth inside a pool;
- ``prefill``: prefill attention on the standard prefill workloads: TFLOP/s, paging's cost, mixed's floor;
- ``prefix``: the prefix cache on a seeded trace of shared system prompts and multi-turn conversations;
- ``step``: host time of one engine step, the building blocks against ``cache.step()``, steady and growing;
- ``swap``: swap-out and swap-in bandwidth against plain cudaMemcpyAsync, with attention running meanwhile; decode
  over host-tier blocks; whole-chunk swap by remapping.
- ``transfer``: a block transfer between two caches on two GPUs (or one): copy engines, peer-mapped kernel and NCCL
  against a plain peer copy of the same bytes.

``harness`` holds what they share (the GPU timer, the ceilings, the run header, tables
and JSON records) and ``cases`` the standard cases. The benchmarks sit on top of the
runtime: they import it; nothing in it imports them. benchmarks/README.md has the figures.
"""
