"""The kernels' interpreter checks (``tests/scripts/check_*.py``): each one read by a test, and every such test dealt
to the one worker that runs them all (``tests/conftest.py``: the ``triton_interpreter`` marker)."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _marked(function: ast.FunctionDef) -> bool:
    return any(ast.unparse(decorator) == "pytest.mark.triton_interpreter" for decorator in function.decorator_list)


def _readers() -> dict[str, list[tuple[str, bool]]]:
    """Each check script's name: the tests that read its result, and whether each carries the marker."""
    readers: dict[str, list[tuple[str, bool]]] = {}
    for path in TESTS.rglob("test_*.py"):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            for call in ast.walk(function):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                        and call.func.id == "cases_checked_under_triton_interpreter"):
                    script = ast.literal_eval(call.args[0])
                    readers.setdefault(script, []).append((f"{path.relative_to(TESTS)}::{function.name}",
                                                           _marked(function)))
    return readers


def test_every_check_script_is_read_by_one_marked_test():
    readers = _readers()
    scripts = {path.name for path in (TESTS / "scripts").glob("check_*.py")}
    assert set(readers) == scripts, (sorted(set(readers) ^ scripts))
    for script, tests in readers.items():
        assert len(tests) == 1, (script, tests)
        [(test, marked)] = tests
        assert marked, f"{test} reads {script} without @pytest.mark.triton_interpreter"
