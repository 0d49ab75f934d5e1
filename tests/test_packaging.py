"""The package declares what it imports: `pip install .` gives a package that imports, its extras give the book,
JupyterLab, the cluster back-ends and the tests, and requirements.txt (the lock the README's commands install)
pins a version of each that the declared ranges admit."""

import ast
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO

# import name -> distribution, where the two differ
DISTRIBUTION = {"PIL": "pillow", "pynvml": "nvidia-ml-py", "yaml": "pyyaml", "sklearn": "scikit-learn",
                "markdown_it": "markdown-it-py"}
# imports the package makes only where a GPU tool provides them (Nsight Compute's report module)
PROVIDED = {"ncu_report"}


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def declared() -> dict[str, list[Requirement]]:
    p = project()
    groups = {"": p["dependencies"], **p["optional-dependencies"]}
    return {g: [Requirement(r) for r in reqs] for g, reqs in groups.items()}


def third_party_imports() -> set[str]:
    names = set()
    for path in (REPO / "medddpm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "medddpm" and n not in PROVIDED}


def test_every_import_of_the_package_is_a_declared_distribution():
    names = {canonicalize_name(r.name) for reqs in declared().values() for r in reqs}
    missing = sorted(n for n in third_party_imports() if canonicalize_name(DISTRIBUTION.get(n, n)) not in names)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_core_needs_no_extra_for_training_and_measuring():
    core = {canonicalize_name(r.name) for r in declared()[""]}
    for name in ("torch", "numpy", "pandas", "pyarrow", "nibabel", "papermill", "nvidia-ml-py"):
        assert name in core


def test_the_lock_pins_a_version_every_declared_range_admits():
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^;\s]+)\s*(;.+)?", line)  # a pin, maybe for some platforms
            assert m, f"requirements.txt: not an exact pin: {line!r}"
            pins[canonicalize_name(m[1])] = m[2]
    for group, reqs in declared().items():
        for r in reqs:
            name = canonicalize_name(r.name)
            assert name in pins, f"{r.name} ({group or 'core'}) is not pinned in requirements.txt"
            assert r.specifier.contains(pins[name], prereleases=True), \
                f"requirements.txt pins {r.name}=={pins[name]}, outside pyproject's {r.specifier} ({group or 'core'})"
