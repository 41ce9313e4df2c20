"""The package a user installs the ordinary way: ``pip install .`` builds a wheel, not an editable link.

The suite itself runs on an editable install, which finds every folder of the source tree whatever the
package list says; this test builds the wheel from a copy of the sources, installs it into a fresh
virtualenv and runs a compile and an ``explain`` from it, in a folder where the sources cannot be imported.
"""

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", ".whl", "build", "*.egg-info", "__pycache__", "demo_out",
                                      "bench", "tests", "docs")

_USE_THE_WHEEL = textwrap.dedent("""
    import pathlib, sys
    import torch
    import fp8graph
    installed = pathlib.Path(fp8graph.__file__).resolve()
    assert pathlib.Path(sys.prefix).resolve() in installed.parents, installed
    for name in ("passes", "models", "fsdp", "regions", "targets", "kernels"):
        assert (installed.parent / name / "__init__.py").is_file(), name

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 32)
    compiled = fp8graph.compile(model, compiler="aot_eager", regions=None)
    compiled(x).sum().backward()
    assert sum(d.rewritten for d in compiled.fp8graph_backend.decisions) == 2
    report = fp8graph.explain(model, x)
    assert [(r.path, type(r.recipe).__name__) for r in report] == [("0", "Float8CurrentScaling"),
                                                                  ("2", "Float8CurrentScaling")]
    via_entry_point = torch.compile(model, backend="fp8", options={"compiler": "aot_eager"})
    assert via_entry_point(x).shape == (8, 16)
    print("ok", installed)
""")


def _site_packages(python: pathlib.Path) -> str:
    return subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()


def test_the_built_wheel_installs_into_a_fresh_virtualenv_and_compiles(tmp_path):
    sources = tmp_path / "sources"
    shutil.copytree(ROOT, sources, ignore=_NOT_SOURCES)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(sources)], check=True)
    wheel, = (tmp_path / "wheel").glob("fp8graph-*.whl")

    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True)
    # torch and rich, the wheel's dependencies, come from the test environment (installing torch again
    # would take minutes): a path entry reads them, and the test environment's own fp8graph, installed
    # editable through a .pth hook in that folder, is not loaded that way.
    pathlib.Path(_site_packages(python), "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    run = subprocess.run([str(python), "-c", _USE_THE_WHEEL], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.startswith("ok ")
