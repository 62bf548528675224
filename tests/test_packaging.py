"""What `pip install .` ships: every package of the source tree, and the CUDA sources."""

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setup_cfg_lists_every_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = {name.strip() for name in cfg["options"]["packages"].split(",")}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pagedrt").rglob("__init__.py")}
    assert found <= listed, f"setup.cfg's packages lack {sorted(found - listed)}"
    assert "pagedrt.cuda_src" in listed


def test_the_test_extra_builds_nothing_from_source():
    """The README's test command needs the `test` extra; llama-cpp-python (llama.cpp, built from source) stays in
    `oracle`, whose tests skip without it."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = {name: {line.split("=")[0].split(">")[0].strip() for line in value.split("\n") if line.strip()}
              for name, value in cfg["options.extras_require"].items()}
    assert "llama-cpp-python" not in extras["test"] and "llama-cpp-python" in extras["oracle"]
    assert {"pytest", "hypothesis"} <= extras["test"]
