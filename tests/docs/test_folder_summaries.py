"""Each folder of the package says what it holds: its ``__init__`` docstring names every module and
sub-folder in it (as ``name``), so that a reader who opens the folder's summary finds every file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kilnproxy"
FOLDERS = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if "static" not in p.parts)


def _parts(folder: Path) -> list[str]:
    modules = [p.stem for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    subfolders = [p.parent.name for p in folder.glob("*/__init__.py")]
    return sorted(modules + subfolders)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_every_module_is_named_in_its_folders_summary(folder):
    summary = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    assert "TODO" not in summary, f"{folder / '__init__.py'}: the summary is a placeholder"
    missing = [name for name in _parts(folder) if f"``{name}``" not in summary and f"``{name}/``" not in summary]
    assert not missing, f"{folder / '__init__.py'} does not name {', '.join(missing)} (as ``name``)"
