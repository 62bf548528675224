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
