"""Which packages the distribution holds, found rather than listed.

The FX passes and the model zoo sit at the top of the repository, so each stage of the pipeline is a
folder a newcomer sees, and install as ``fp8graph.passes`` and ``fp8graph.models``. setuptools'
discovery finds every package under each of the three folders; everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDER_OF_PACKAGE = {"fp8graph": "fp8graph", "fp8graph.passes": "passes", "fp8graph.models": "models"}


def packages_under(package: str, folder: str) -> list[str]:
    return [package] + [f"{package}.{sub}" for sub in find_packages(folder)]


setup(
    packages=[name for package, folder in FOLDER_OF_PACKAGE.items() for name in packages_under(package, folder)],
    package_dir=FOLDER_OF_PACKAGE,
)
