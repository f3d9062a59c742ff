from __future__ import annotations

import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def write_model(tmp_path: Path):
    """Write a model file into tmp_path and return its path."""
    def write(source: str, name: str = "model_file.py") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return str(path)
    return write
