"""Builds the wheel of chattts-triton (pyproject.toml holds the rest): the package `chattts_triton`, and inside it the
repository's command folders, so that the wheel installs no other top-level name (`client`, `export`, `gateway`
could be any project's):

    export/            -> chattts_triton/export/       python -m chattts_triton.export
    model_repository/  -> chattts_triton/export/model_repository/   the template every export starts from
    gateway/           -> chattts_triton/gateway/      python -m chattts_triton.gateway | chattts_triton.gateway.wyoming
    client/            -> chattts_triton/client/       python -m chattts_triton.client (less demo.py, which exports
                                                        and starts a server: the repository's)

In the repository they stay where they are and run as `python -m export`, `python -m gateway`, `python -m client`.
As they are copied, their imports of one another (`from client.contract import ...`, `from export.codec import ...`),
the app that uvicorn's workers import ("gateway.app:app_from_env") and the `python -m` names of their help are
rewritten to the package's names, and every import left is checked: no staged module imports `client`, `export`,
`gateway`, `bench`, `loadtest`, `tools` or `tests` (packaging/staging.py, which the client's own distribution,
packaging/client, shares). The gateway's client is this staged `chattts_triton.client`: the project's dependencies
without an extra are the client's own (numpy, tritonclient), and no second distribution has to be found.

build_py writes the staged folders into the package it built. An editable install (`pip install -e .`, make setup)
has none: there the repository's folders are used, from its root. An sdist carries the folders (MANIFEST.in).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE = "chattts_triton"
STAGED = {"client": {"demo.py"}, "export": set(), "gateway": set()}  # folder -> what stays in the repository
TEMPLATE = "model_repository"  # copied into chattts_triton/export/, where the staged exporter looks first
FORBIDDEN = ("client", "export", "gateway", "bench", "loadtest", "tools", "tests")

_NAMES = "|".join(STAGED)
REWRITES = [
    (rf"^(\s*)from ({_NAMES})((?:\.\w+)*) import\b", rf"\1from {PACKAGE}.\2\3 import"),
    (rf"""(["'])({_NAMES})((?:\.\w+)*:\w+)\1""", rf"\1{PACKAGE}.\2\3\1"),  # "gateway.app:app_from_env"
    (rf"\b(python3?) -m ({_NAMES})\b", rf"\1 -m {PACKAGE}.\2"),
]


def _staging():
    """packaging/staging.py, loaded by its path (it is no package)."""
    spec = importlib.util.spec_from_file_location("_chattts_triton_staging", ROOT / "packaging" / "staging.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stage(root: Path, package: Path) -> list[Path]:
    """Writes `package`/{client,export,gateway}/ (`package` the built chattts_triton) from `root`'s folders, and the
    model repository template into export/; refuses (SystemExit) a staged import of a folder of the repository.
    Returns the staged package folders."""
    staging = _staging()
    staged = []
    for name, left_out in STAGED.items():
        staging.copy_package(root / name, package / name, REWRITES, left_out)
        staged.append(package / name)
    shutil.copytree(root / TEMPLATE, package / "export" / TEMPLATE,
                    ignore=shutil.ignore_patterns("__pycache__", "*.py[co]"))
    problems = [p for folder in staged
                for p in staging.staged_problems(folder, FORBIDDEN, label=f"{PACKAGE}.{folder.name}")]
    if problems:
        raise SystemExit(f"the {PACKAGE} wheel would import the repository's folders:\n  " + "\n  ".join(problems))
    return staged


class BuildPy(build_py):
    """build_py, then the staged folders inside the built package (not for an editable install)."""

    def run(self):
        super().run()
        if not self.editable_mode:
            stage(ROOT, Path(self.build_lib) / PACKAGE)


if __name__ == "__main__":  # as setuptools runs it; tests/test_client_package.py imports the helpers
    setup(cmdclass={"build_py": BuildPy})
