"""The package's layering, as the README draws it: each layer imports only from the layers below it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# layer -> the layers it may import from
ALLOWED = {
    "kernels": set(),
    "model": set(),
    "tasks": {"model"},
    "engine": {"model", "kernels"},
    "run": {"model"},
    "rl": {"model", "tasks", "engine", "run", "kernels"},
}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "minigrpo" and len(parts) > 1 else None


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # `from package import module` imports the module; else the package's name
                yield f"{node.module}.{a.name}"
                yield node.module


def test_every_layer_imports_only_from_the_layers_below_it():
    files = sorted((ROOT / "minigrpo").glob("*/*.py"))
    assert len(files) > 30
    wrong = []
    for f in files:
        src = layer_of(".".join(f.relative_to(ROOT).with_suffix("").parts))
        assert src in ALLOWED, f"{f} is in no layer of the README's layout"
        for target in filter(None, map(layer_of, imports(f))):
            if target != src and target not in ALLOWED[src]:
                wrong.append(f"{f.relative_to(ROOT)} imports {target}")
    assert not wrong, "imports against the layering: " + "; ".join(wrong)


def test_no_import_cycle():
    files = sorted((ROOT / "minigrpo").glob("*/*.py"))
    name = {f: ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for f in files}
    modules = set(name.values())
    graph = {name[f]: {m for m in imports(f) if m in modules} - {name[f]} for f in files}

    def visit(m, path):
        assert m not in path, "import cycle: " + " -> ".join(path[path.index(m):] + [m])
        for n in graph[m]:
            visit(n, path + [m])

    for m in graph:
        visit(m, [])
