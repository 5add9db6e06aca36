"""The examples in README.md, docs/checkpoints.md and docs/data.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/checkpoints.md", "docs/data.md"])
def test_python_examples_run(doc, tmp_path, monkeypatch):
    blocks = _blocks(doc)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        try:
            exec(compile(code, doc, "exec"), {"__name__": "__doc_example__"})
        except SystemExit as done:  # README's loop ends with sys.exit(mgr.exit_code): 0, no stop signal came
            assert done.code == 0, f"{doc}: an example exited {done.code}"
    assert (tmp_path / "ckpts").exists()
