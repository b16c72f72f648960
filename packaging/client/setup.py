"""Builds the client distribution `chattts-triton-client` (import name `chattts_client`) from the repository.

The sources stay where the project keeps them: `client/` (less `demo.py`, which starts a server) becomes
`chattts_client/`, and the two modules of the server package the client reads, `chattts_triton/config.py` (the
contract's names, limits and sample rate) and `chattts_triton/model/split.py` (the sentence splitter), are copied
in as `chattts_client/_shared/`. Their imports are rewritten to point there, and every import left is checked: the
staged package imports nothing of `chattts_triton`, of `client` or torch, so it runs with numpy and tritonclient alone.
The copying, rewriting and checking are `packaging/staging.py`'s, which the project's own wheel (the root `setup.py`,
which stages `client/`, `export/` and `gateway/` inside `chattts_triton`) shares.

Staged under `src/` beside this file, from the repository two levels up (or $CHATTTS_TRITON_ROOT, as
tests/test_client_package.py builds a copy of this folder). An sdist carries `src/`; built from one, there is no
repository above and the staged sources are used as they are.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("CHATTTS_TRITON_ROOT") or HERE.parents[1])
STAGE = HERE / "src"
PACKAGE = "chattts_client"
LEFT_OUT = {"demo.py"}  # python -m client.demo exports and starts a server: the repository's, not the client's

# import rewrites, in order: (pattern, replacement); relative, so that the package works under any name
CLIENT_REWRITES = [
    (r"^(\s*)from chattts_triton import config\b", r"\1from ._shared import config"),
    (r"^(\s*)from chattts_triton\.config import\b", r"\1from ._shared.config import"),
    (r"^(\s*)from chattts_triton\.model\.split import\b", r"\1from ._shared.split import"),
    (r"^(\s*)from client\.(\w+) import\b", r"\1from .\2 import"),
]
SPLIT_REWRITES = [(r"^(\s*)from \.\.config import\b", r"\1from .config import")]
TEXT_REWRITES = [(r"python -m client\b", "python -m chattts_client")]
FORBIDDEN = ("chattts_triton", "client", "torch", "export", "gateway", "loadtest", "bench")


@functools.cache
def _staging():
    """packaging/staging.py (the rewrites and checks the project's wheel shares), loaded by its path: an sdist, which
    has no repository above it, builds from its staged sources and never needs it."""
    spec = importlib.util.spec_from_file_location("_chattts_triton_staging", ROOT / "packaging" / "staging.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_staged(package: Path) -> None:
    """Every import is of numpy, tritonclient or the standard library's kind (nothing in FORBIDDEN), and every
    relative one finds its module inside the staged package."""
    problems = _staging().staged_problems(package, FORBIDDEN, label="client")
    if problems:
        raise SystemExit("the client package would need the server or torch:\n  " + "\n  ".join(problems))


def stage(root: Path, out: Path) -> Path:
    """Writes `out/chattts_client/` from `root`'s client/ and the two shared modules; returns the package folder."""
    staging = _staging()
    package = out / PACKAGE
    staging.copy_package(root / "client", package, [*CLIENT_REWRITES, *TEXT_REWRITES], left_out=LEFT_OUT)
    (package / "_shared").mkdir()
    (package / "_shared" / "__init__.py").write_text(
        '"""Copies of chattts_triton.config and chattts_triton.model.split, made when this package was built."""\n',
        encoding="utf-8")
    shutil.copyfile(root / "chattts_triton" / "config.py", package / "_shared" / "config.py")
    split = (root / "chattts_triton" / "model" / "split.py").read_text(encoding="utf-8")
    (package / "_shared" / "split.py").write_text(staging.rewrite(split, SPLIT_REWRITES), encoding="utf-8")
    check_staged(package)
    return package


if __name__ == "__main__":  # as setuptools runs it; tests/test_client_package.py imports the helpers
    if (ROOT / "client" / "__init__.py").is_file() and (ROOT / "chattts_triton" / "config.py").is_file():
        stage(ROOT, STAGE)
    setup()
