"""The package's shape, checked from its source (AST, no imports): no import circles, no private
name imported from another module, and every import points down the layers

    base < models < runtime < engine < cluster, io < moa, sim, diffusion, demo < cli

(imports inside functions and under TYPE_CHECKING count, as a reader sees them). The scheduling
policies that the runtime, the plugin and the simulator share import neither torch nor Dask."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "batchgen"
# module-name prefix -> layer; the longest matching prefix decides
LAYERS = {
    "batchgen": 0,  # errors, outputs, config, sampling params, tokenizer, progress, structured/, policy/
    "batchgen.models": 1, "batchgen.offload": 1,
    "batchgen.runtime": 2, "batchgen.sampler": 2, "batchgen.structured.rows": 2,  # a row's grammar state
    "batchgen.engine": 3,
    "batchgen.cluster": 4, "batchgen.io": 4,
    "batchgen.moa": 5, "batchgen.sim": 5, "batchgen.diffusion": 5, "batchgen.demo": 5,
    "batchgen.cli": 6,
    "batchgen.__main__": 6,  # `python -m batchgen`: the CLI
}
FRONT = "batchgen"  # the package's __init__ re-exports the front ends' names (lazily)
HEAVY = ("torch", "distributed", "dask", "cupy", "triton")


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()
# Pure policies: state in, decisions out (shared by runtime, plugin and simulator)
POLICIES = ("batchgen.policy.balance", "batchgen.policy.speed", "batchgen.runtime.policy",
            "batchgen.runtime.prefix_order", "batchgen.runtime.length_order", "batchgen.policy.length_prediction",
            "batchgen.policy.expert_eviction", "batchgen.policy.diffusion_step",
            "batchgen.policy.diffusion_plan", "batchgen.policy.diffusion_steal", "batchgen.policy.diffusion_cost",
            "batchgen.sim.policies")


def _imports(name: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import statement of `name`."""
    path = MODULES[name]
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(target, a.name, node.lineno) for a in node.names]
    return found


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name in MODULES:
        deps = set()
        for target, what, _ in _imports(name):
            full = f"{target}.{what}"
            deps.add(full if full in MODULES else target if target in MODULES else "")
        deps.discard("")
        deps.discard(name)
        edges[name] = {d for d in deps if not d.startswith(name + ".")}  # a package's own submodules
    return edges


def _layer(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[best]


def test_no_import_circles() -> None:
    edges = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 and not all(MODULES[c].name == "__init__.py" for c in comp):
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert circles == []


def test_no_private_names_imported_across_modules() -> None:
    private = [f"{name}:{line} imports {target}.{what}" for name in MODULES
               for target, what, line in _imports(name)
               if target in MODULES and target != name and what.startswith("_") and not what.startswith("__")]
    assert private == []


def test_imports_point_down_the_layers() -> None:
    upward = [f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})"
              for name, deps in _edges().items() if name != FRONT
              for dep in deps if dep != FRONT and _layer(dep) > _layer(name)]
    assert upward == []


# the diffusion wing's sub-layers, bottom up: the models and the collectives know nothing of
# requests, the engine nothing of Dask, the Dask side nothing of the front ends
DIFFUSION_LAYERS = {"batchgen.diffusion.models": 0, "batchgen.diffusion.parallel": 0,
                    "batchgen.diffusion.engine": 1, "batchgen.diffusion.distributed": 2,
                    "batchgen.diffusion.jobs": 3}


def _diffusion_layer(name: str) -> int | None:
    return next((layer for prefix, layer in DIFFUSION_LAYERS.items()
                 if name == prefix or name.startswith(prefix + ".")), None)


def test_every_diffusion_module_sits_in_a_sub_layer() -> None:
    loose = [name for name in MODULES if name.startswith("batchgen.diffusion.") and _diffusion_layer(name) is None]
    assert loose == []


def test_diffusion_imports_point_down_its_sub_layers() -> None:
    upward = [f"{name} imports {dep}" for name, deps in _edges().items() if _diffusion_layer(name) is not None
              for dep in deps if (_diffusion_layer(dep) or 0) > _diffusion_layer(name)]
    assert upward == []


def test_kernels_do_not_import_batchgen() -> None:
    def imported(node: ast.AST) -> list[str]:
        if isinstance(node, ast.ImportFrom):
            return [node.module or ""]
        return [a.name for a in node.names] if isinstance(node, ast.Import) else []

    hits = [f"{p.name} imports {m}" for p in (PACKAGE.parent / "kernels").rglob("*.py")
            for n in ast.walk(ast.parse(p.read_text())) for m in imported(n) if m.split(".")[0] == "batchgen"]
    assert hits == []


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_import_neither_torch_nor_dask(policy: str) -> None:
    seen, todo, heavy = set(), [policy], []
    while todo:  # the policy and every batchgen module it reaches
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for target, what, line in _imports(name):
            if target.split(".")[0] in HEAVY:
                heavy.append(f"{name}:{line} imports {target}")
            full = f"{target}.{what}"
            todo += [m for m in (full, target) if m in MODULES and m != FRONT][:1]
    assert heavy == []
