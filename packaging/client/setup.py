"""Builds the client distribution `chattts-triton-client` (import name `chattts_client`) from the repository.

The sources stay where the project keeps them: `client/` (less `demo.py`, which starts a server) becomes
`chattts_client/`, and the two modules of the server package the client reads, `chattts_triton/config.py` (the
contract's names, limits and sample rate) and `chattts_triton/model/split.py` (the sentence splitter), are copied
in as `chattts_client/_shared/`. Their imports are rewritten to point there, and every import left is checked: the
staged package imports nothing of `chattts_triton`, of `client` or torch, so it runs with numpy and tritonclient alone.

Staged under `src/` beside this file, from the repository two levels up (or $CHATTTS_TRITON_ROOT, as
tests/test_client_package.py builds a copy of this folder). An sdist carries `src/`; built from one, there is no
repository above and the staged sources are used as they are.
"""

from __future__ import annotations

import ast
import os
import re
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


def _rewrite(text: str, rules) -> str:
    for pattern, replacement in rules:
        text = re.sub(pattern, replacement, text, flags=re.M)
    return text


def absolute_imports(source: str):
    """(line, top-level name) of every absolute import in `source`, those inside functions too."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module.split(".")[0]


def relative_imports(source: str):
    """(line, level, module) of every relative import in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            yield node.lineno, node.level, node.module or ""


def check_staged(package: Path) -> None:
    """Every absolute import is of numpy, tritonclient or the standard library's kind (nothing in FORBIDDEN), and
    every relative one finds its module inside the staged package."""
    problems = [f"{path.relative_to(package.parent)}:{line} imports {name}"
                for path in sorted(package.rglob("*.py"))
                for line, name in absolute_imports(path.read_text(encoding="utf-8")) if name in FORBIDDEN]
    for path in sorted(package.rglob("*.py")):
        for line, level, module in relative_imports(path.read_text(encoding="utf-8")):
            base = path.parents[level - 1]
            target = base.joinpath(*module.split(".")) if module else base
            if not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()) \
                    or package not in (target, *target.parents):
                problems.append(f"{path.relative_to(package.parent)}:{line} imports {'.' * level}{module}, "
                                "which is not in the client package")
    if problems:
        raise SystemExit("the client package would need the server or torch:\n  " + "\n  ".join(problems))


def stage(root: Path, out: Path) -> Path:
    """Writes `out/chattts_client/` from `root`'s client/ and the two shared modules; returns the package folder."""
    package = out / PACKAGE
    shutil.rmtree(package, ignore_errors=True)
    (package / "_shared").mkdir(parents=True)
    for src in sorted((root / "client").glob("*.py")):
        if src.name not in LEFT_OUT:
            text = _rewrite(_rewrite(src.read_text(encoding="utf-8"), CLIENT_REWRITES), TEXT_REWRITES)
            (package / src.name).write_text(text, encoding="utf-8")
    (package / "_shared" / "__init__.py").write_text(
        '"""Copies of chattts_triton.config and chattts_triton.model.split, made when this package was built."""\n',
        encoding="utf-8")
    shutil.copyfile(root / "chattts_triton" / "config.py", package / "_shared" / "config.py")
    split = (root / "chattts_triton" / "model" / "split.py").read_text(encoding="utf-8")
    (package / "_shared" / "split.py").write_text(_rewrite(split, SPLIT_REWRITES), encoding="utf-8")
    check_staged(package)
    return package


if __name__ == "__main__":  # as setuptools runs it; tests/test_client_package.py imports the helpers
    if (ROOT / "client" / "__init__.py").is_file() and (ROOT / "chattts_triton" / "config.py").is_file():
        stage(ROOT, STAGE)
    setup()
