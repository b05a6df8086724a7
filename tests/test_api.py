"""The public API's edge: each public module's `__all__` holds public names only, each importable and documented in
docs/api.md, which lists nothing else."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def documented() -> dict[str, list[str]]:
    """docs/api.md's names, per module section."""
    sections: dict[str, list[str]] = {}
    module = None
    for line in API.read_text().splitlines():
        heading = re.fullmatch(r"## `([\w.]+)`", line)
        if heading:
            module = sections.setdefault(heading.group(1), [])
        elif module is not None and (entry := re.match(r"- `(\w+)` — ", line)):
            module.append(entry.group(1))
    return sections


@pytest.mark.parametrize("name", list(documented()))
def test_each_public_module_exports_what_the_reference_documents(name):
    module = importlib.import_module(name)
    assert sorted(module.__all__) == sorted(documented()[name])
    for public in module.__all__:
        assert not public.startswith("_"), public
        assert hasattr(module, public), public


def test_every_public_module_is_in_the_reference():
    """Every module of the package with no underscore in its dotted name is documented (the internal ones have one);
    `accumnorm.integrations` only holds the integrations."""
    root = Path(importlib.import_module("accumnorm").__file__).parent
    names = {".".join(("accumnorm", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
             for path in root.rglob("*.py")}
    public = {name for name in names if not any(part.startswith("_") for part in name.split("."))}
    assert public - {"accumnorm.integrations"} == set(documented())
