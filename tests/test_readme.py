"""The README's example runs as written (on the host backend here, on a GPU where there is one)."""

import re
from pathlib import Path


def test_readme_example_runs(capsys):
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert "Translation(seq=" in capsys.readouterr().out
