"""The package's shape: imports go one way, down the pipeline, lazy imports included."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module_name(path: pathlib.Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] == "passes":  # installed as fp8graph.passes
        parts = ["fp8graph", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """Every fp8graph module ``path`` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                found.add(candidate)
    return found


def _graph() -> dict[str, set[str]]:
    files = [*ROOT.joinpath("fp8graph").rglob("*.py"), *ROOT.joinpath("passes").rglob("*.py")]
    names = {_module_name(path): path for path in files}
    # A package's __init__ re-exports its modules; an import of the package is not a dependency cycle.
    return {name: {dep for dep in _imports(path, name, set(names)) if not name.startswith(dep + ".")}
            for name, path in names.items() if not path.name == "__init__.py"}


def test_no_module_of_fp8graph_or_its_passes_imports_itself_back():
    graph = _graph()
    cycles = []

    def visit(module, stack, on_stack, done):
        stack.append(module)
        on_stack.add(module)
        for dep in sorted(graph.get(module, ())):
            if dep in on_stack:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in done:
                visit(dep, stack, on_stack, done)
        on_stack.discard(module)
        stack.pop()
        done.add(module)

    done = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [], set(), done)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)
