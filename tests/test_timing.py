"""tools/timing.py, the benchmarks' event timer, against a fake CUDA clock (runs in CI)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

TIMING = Path(__file__).resolve().parents[1] / "tools" / "timing.py"
spec = importlib.util.spec_from_file_location("tools_timing", TIMING)
timing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timing)


class FakeCuda:
    """Events stamped with a clock that each timed call advances by the next of ``durations_ms``."""

    def __init__(self, durations_ms):
        self.now, self.durations, self.calls = 0.0, list(durations_ms), 0
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass

        self.cuda = SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: b.t - a.t)

    def call(self):
        self.calls += 1
        self.now += self.durations.pop(0)


def test_event_seconds_is_the_median_of_the_timed_calls_after_the_warmup():
    cp = FakeCuda([100.0, 100.0, 4.0, 2.0, 9.0, 3.0, 5.0])  # two warm-up calls, then five timed ones
    assert timing.event_seconds(cp, cp.call, repeats=5, warmup=2) == 4.0e-3  # median of 4, 2, 9, 3, 5 ms
    assert cp.calls == 7 and not cp.durations
