"""docs/interface.md's embedding example runs as written (and stays short)."""

from __future__ import annotations

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "interface.md"


def test_the_embedding_example_runs() -> None:
    [code] = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(code.strip().splitlines()) <= 60
    exec(compile(code, str(DOC), "exec"), {"__name__": "interface_doc"})
