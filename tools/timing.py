"""The CUDA-event timer the benchmark scripts share."""

import statistics


def event_seconds(cp, fn, repeats, warmup=0):
    """Median seconds of ``fn()`` between two CUDA events, one call at a time (after ``warmup`` calls).

    Each call is waited for, so this includes any launch gap: right for calls that
    synchronise inside, or long enough for the gap not to matter.
    """
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
    return statistics.median(times)
