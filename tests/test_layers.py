"""The packages' imports point one way: down the layers written in docs/architecture.md.

Every module's imports are read from its source -- those inside functions (lazy) and under
``TYPE_CHECKING`` too -- and an import of a higher layer, or of a sibling package on the same
layer, fails with the line that makes it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, int], ...] = (
    # estimators: core types -> task -> hardware -> runtime -> tracing -> memory -> timing -> estimator -> probing
    ("estimators._types", 0), ("estimators._errors", 0), ("estimators._units", 0), ("estimators._config", 0),
    ("estimators._step_options", 0),
    ("estimators.task", 1),
    ("estimators.hardware", 2),
    ("estimators.runtime", 3),
    ("estimators.tracing", 4),
    ("estimators.memory", 5),
    ("estimators.timing", 6),
    ("estimators.estimator", 7),
    ("estimators.probing", 8),
    ("estimators", 9),  # the package itself: its public names
    # memplan: utilities -> training | planning -> reports -> diagnostics | integrations -> option sources -> fit -> cli
    ("memplan._version", 0),
    ("memplan._paths", 10), ("memplan._figures", 10), ("memplan.nn", 10),
    ("memplan.training", 11), ("memplan.planning", 11),
    ("memplan.reports", 12),
    ("memplan.diagnostics", 13),
    ("memplan.integrations", 13),
    ("memplan._option_sources", 14),
    ("memplan._fit", 15),
    ("memplan.cli", 16),
    ("memplan", 17),
)
"""(module or package, layer): a module's layer is that of the longest name it starts with;
a module may import its own package's modules, and any module of a lower layer."""


def layer_of(module: str) -> tuple[int, str]:
    """(layer, the LAYERS name it falls under)."""
    found = [(len(name), rank, name) for name, rank in LAYERS if module == name or module.startswith(name + ".")]
    if not found:
        raise KeyError(f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)")
    _, rank, name = max(found)
    return rank, name


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every memplan/estimators import of ``path``, wherever it is."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # "from pkg import module" imports the module
                full = f"{target}.{a.name}"
                is_module = (ROOT / (full.replace(".", "/") + ".py")).exists() or (ROOT / full.replace(".", "/")).is_dir()
                out.append((node.lineno, full if is_module else target))
    return [(line, m) for line, m in out if m.split(".")[0] in ("memplan", "estimators")]


def _is_module(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("_")


def upward_imports(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        module = module_name(path)
        rank, group = layer_of(module)
        for line, target in imported(path):
            target_rank, target_group = layer_of(target)
            # Packages of one layer are siblings that do not import each other (the layer's
            # loose modules, such as the core types, are one group).
            siblings = target_rank == rank and target_group != group and not (
                _is_module(group) or _is_module(target_group))
            if target_rank > rank or siblings:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} (layer {rank}) imports {target} "
                           f"(layer {target_rank}{', a sibling' if target_rank == rank else ''})")
    return bad


SOURCES = sorted([*ROOT.glob("estimators/**/*.py"), *ROOT.glob("memplan/**/*.py")])


def test_every_import_points_down_the_layers():
    assert SOURCES
    bad = upward_imports(SOURCES)
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_the_check_catches_an_import_that_points_up(tmp_path, monkeypatch):
    # A module of the task layer importing the estimator, lazily inside a function, and a
    # training module importing planning (a sibling): both found.
    fake = tmp_path / "estimators" / "task"
    fake.mkdir(parents=True)
    (fake / "_bad.py").write_text("def f():\n    from ..estimator._estimate import Estimator\n")
    sibling = tmp_path / "memplan" / "training"
    sibling.mkdir(parents=True)
    (sibling / "_bad.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from ..planning import Plan\n")
    for p in ("estimators/estimator", "memplan/planning"):
        (tmp_path / p).mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = upward_imports([fake / "_bad.py", sibling / "_bad.py"])
    assert len(bad) == 2 and "estimators.estimator" in bad[0] and "a sibling" in bad[1], bad


@pytest.mark.parametrize("package", ["memplan", "estimators"])
def test_at_most_eight_modules_at_a_packages_top(package):
    top = sorted(p.name for p in (ROOT / package).glob("*.py"))
    assert len(top) <= 8, top
