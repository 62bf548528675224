"""The host's share of a decode step of the engine, without a GPU: its Python per step, and the step's wall time
beside a simulated GPU step.

    PYTHONPATH=. python3 tools/host_step.py [--model PATH] [--batches 1,64] [--gpu-ms 0,0.4] [--steps 200]
    PYTHONPATH=/path/to/an/older/checkout python3 tools/host_step.py ...   # the same for an older engine

The engine runs on the host backend with the model's forward replaced by a stand-in that returns fixed logits of
512 columns at once, so a step's time is the host's: scheduling, ``cache.step()``, sampling, bookkeeping. With
``--gpu-ms G`` the stand-in also simulates a GPU stream: each forward is queued behind the last and takes G ms,
and reading a step's tokens waits for it (an engine without ``overlap`` waits inside the forward, as its
``.get()`` did). Greedy, ``batch`` prompts of 64 random tokens, 200 tokens each, no stop token; per row the
wall time of a decode step (ms: the least of 7 runs of each one's mean over its decode steps).
"""

import argparse
import inspect
import time

import numpy as np

from pagedrt.engine import Engine, SamplingParams, fetch


class StandIn:
    """A forward pass that costs the host nothing and, with ``gpu_s``, a simulated stream's time."""

    def __init__(self, model, gpu_s, sync):
        self.model, self.gpu_s, self.sync, self.done = model, gpu_s, sync, 0.0
        self.stream = model.stream
        self.logits = np.random.default_rng(0).standard_normal((4096, 512)).astype(np.float32)

    def forward(self, step, ids):
        self.done = max(time.perf_counter(), self.done) + self.gpu_s
        if self.sync:
            self.wait()
        return self.logits[:len(step.seqs)]

    def wait(self, until=None):
        until = self.done if until is None else until
        while time.perf_counter() < until:
            pass


class Event:
    """A step's simulated end, recorded when its tokens' copy is queued."""

    def __init__(self, standin):
        self.standin, self.done = standin, standin.done

    def synchronize(self):
        self.standin.wait(self.done)


def step_ms(engine, standin, batch, gpu_ms, steps, repeats=7):
    """The least over ``repeats`` runs of a decode step's mean wall time (ms): the machine's other load only adds."""
    from pagedrt.engine.engine import Stats
    standin.gpu_s = gpu_ms * 1e-3
    times = []
    for seed in range(repeats):
        prompts = list(np.random.default_rng(seed).integers(0, 512, (batch, 64)))
        engine.stats = Stats()
        engine.generate(prompts, SamplingParams(max_tokens=steps))
        times.append(engine.stats.decode_seconds / engine.stats.decode_steps * 1e3)
    return min(times)


def engine(path, batch, **overlap):
    """An engine on the host backend whose forward is a :class:`StandIn`'s, and the stand-in."""
    e = Engine(path, backend="host", max_seqs=batch, kv_tokens=batch * 320, **overlap)
    e.stop_tokens = np.empty(0, np.int64)
    standin = e.model = StandIn(e.model, 0.0, not overlap)
    if overlap:
        send = e._tokens.send
        e._tokens.send = lambda count: (send(count)[0], Event(standin))
    return e, standin


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--gpu-ms", default="0,0.4")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    path = args.model or fetch.default_path()
    modes = [{"overlap": False}, {"overlap": True}] if "overlap" in inspect.signature(Engine).parameters else [{}]
    batches, gpu = [int(b) for b in args.batches.split(",")], [float(g) for g in args.gpu_ms.split(",")]
    engines = [engine(path, max(batches), **m) for m in modes]
    print(f"{'batch':>5} {'gpu ms':>6} " + " ".join(f"{str(m or 'before'):>20}" for m in modes))
    for batch in batches:
        for gpu_ms in gpu:
            times = [step_ms(e, standin, batch, gpu_ms, args.steps) for e, standin in engines]
            print(f"{batch:>5} {gpu_ms:>6.2f} " + " ".join(f"{t:>17.3f} ms" for t in times), flush=True)
    for e, _ in engines:
        e.close()


if __name__ == "__main__":
    main()
