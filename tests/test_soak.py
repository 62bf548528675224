"""A short run of the randomized soak (tools/soak.py): 200 steps of each config, two seeds."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("tools_soak", ROOT / "tools" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("config", sorted(soak.CONFIGS))
def test_soak_breaks_no_invariant(config, seed):
    steps, failed = soak.run(config, seed, 200, check_every=8)
    assert steps == 200


def test_the_soak_exits_non_zero_with_a_reproducer_on_a_broken_invariant(monkeypatch, capsys):
    def broken(snap, model):
        raise soak.Broken("injected")
    monkeypatch.setattr(soak, "check_state", broken)
    assert soak.main(["--steps", "5", "--configs", "tight", "--seed", "4"]) == 1
    out = capsys.readouterr().out
    assert "BROKEN" in out and "--configs tight --seed 4 --steps 1" in out
