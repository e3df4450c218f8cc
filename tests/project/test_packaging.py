"""pyproject's hand-written package list covers every package in the tree (a wheel holds only those),
and every name a package exports can be reached."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "batchgen").rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert config["package-dir"]["batchgen_kernels"] == "kernels" and "batchgen_kernels" in listed


def test_every_name_a_package_exports_resolves() -> None:
    """Lazy exports (a package __getattr__ mapping names to modules) point at real modules."""
    import importlib

    broken = []
    for init in sorted((ROOT / "batchgen").rglob("__init__.py")):
        name = ".".join(init.parent.relative_to(ROOT).parts)
        package = importlib.import_module(name)
        for export in getattr(package, "__all__", ()):
            try:
                getattr(package, export)
            except (AttributeError, ImportError) as exc:
                broken.append(f"{name}.{export}: {exc}")
    assert not broken, broken
