"""What a user of the published package gets: every package in the wheel, the examples in the
sdist's manifest, ``memplan --version``, and CI running the README's own test command."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from memplan import __version__
from memplan.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    commands = [b.strip() for b in blocks if "pytest" in b]
    assert len(commands) == 1, f"the README should show one test command, found {commands}"
    return commands[0]


def test_ci_runs_the_readme_test_command_as_written():
    command = _readme_test_command()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci, f"{command!r} is not a line of .ci/run"


def test_the_wheel_holds_every_package_and_its_type_marker(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("memplan-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(str(p.parent.relative_to(ROOT)) for top in ("memplan", "estimators")
                      for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts)
    assert len(packages) > 2
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert missing == [], f"packages missing from the wheel: {missing}"
    assert {"memplan/py.typed", "estimators/py.typed"} <= names
    modules = {str(p.relative_to(ROOT)) for top in ("memplan", "estimators") for p in (ROOT / top).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules <= names, sorted(modules - names)


def test_the_sdist_manifest_carries_the_examples_and_the_docs():
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "recursive-include examples *.py" in manifest and "recursive-include docs" in manifest
    assert list((ROOT / "examples").glob("*.py")), "no examples to carry"


def test_version_names_memplan_and_torch(capsys):
    import torch

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"memplan {__version__} (torch {torch.__version__})"
