"""Tests write only inside their temporary folders."""

from __future__ import annotations

import os
from pathlib import Path

from memplan.planning import default_storage


def test_the_cache_folder_is_a_temporary_one(tmp_path_factory):
    base = Path(tmp_path_factory.getbasetemp()).resolve()
    cache = Path(os.environ["MEMPLAN_CACHE_DIR"]).resolve()
    assert base in cache.parents
    assert default_storage().startswith(f"sqlite:///{cache}")
    assert Path.home().resolve() / ".cache" not in cache.parents
