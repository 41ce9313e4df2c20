"""The package's shape: a folder per stage, and imports that go one way, down the pipeline (lazy ones
included)."""

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


def _graph(folders=("fp8graph", "passes")) -> dict[str, set[str]]:
    files = [path for folder in folders for path in ROOT.joinpath(folder).rglob("*.py")]
    names = {_module_name(path): path for path in files}
    # A package's __init__ re-exports its modules; an import of the package is not a dependency cycle.
    return {name: {dep for dep in _imports(path, name, set(names)) if not name.startswith(dep + ".")}
            for name, path in names.items() if not path.name == "__init__.py"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
    return cycles


def test_no_module_of_fp8graph_or_its_passes_imports_itself_back():
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_no_module_of_the_benchmarks_imports_itself_back():
    """bench's command table imports the workloads, which start their children through bench.forked: the child
    runs the command by the module's name, never importing the table back."""
    cycles = _cycles(_graph(("bench",)))
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


# The stages, lowest first: a module imports from its own stage or lower ones. The top-level modules
# belong to the stage their imports put them in.
STAGES = ["numerics", "kernels", "recipes", "costs", "gemm", "buffers", "fsdp", "targets", "passes", "inspection",
          "backend", "regions", "api", "export", "apps"]
TOP_LEVEL_STAGE = {"fp8graph.policies": "costs", "fp8graph.backend": "backend", "fp8graph.instances": "backend",
                   "fp8graph.api": "api", "fp8graph.compiled_module": "api",
                   "fp8graph.__main__": "apps"}


def _stage(module: str) -> str:
    return TOP_LEVEL_STAGE.get(module) or module.split(".")[1]


def test_imports_go_down_the_pipeline():
    upward = [f"{module} ({_stage(module)}) imports {dep} ({_stage(dep)})"
              for module, deps in sorted(_graph().items()) for dep in sorted(deps)
              if dep != "fp8graph" and STAGES.index(_stage(dep)) > STAGES.index(_stage(module))]
    assert upward == []


def test_the_package_is_a_folder_per_stage_with_few_top_level_modules():
    package = ROOT / "fp8graph"
    top_level = sorted(path.stem for path in package.glob("*.py"))
    subpackages = sorted(path.parent.name for path in package.glob("*/__init__.py"))
    assert len(top_level) <= 12, top_level
    assert set(subpackages) == set(STAGES) - {"passes", "backend", "api"}, subpackages
    assert set(top_level) == {"__init__", "__main__", *(name.split(".")[1] for name in TOP_LEVEL_STAGE)}


def test_tests_mirror_the_stages():
    folders = {path.name for path in (ROOT / "tests").iterdir() if path.is_dir() and any(path.glob("test_*.py"))}
    assert folders == (set(STAGES) - {"backend", "api"}) | {"bench"}
