"""What both distributions' builds share: copy a folder of the repository into a package under another name,
rewriting its imports, and check what the staged package imports.

`packaging/client/setup.py` stages `client/` as `chattts_client` (the client alone); the root `setup.py` stages
`export/`, `gateway/` and `client/` as `chattts_triton.export`, `chattts_triton.gateway` and `chattts_triton.client`
(the project's wheel, which installs no other top-level name). Both load this file by its path: it is no package, and
an sdist of the client, which builds from its staged sources, does without it.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

Rules = Iterable[tuple[str, str]]


def rewrite(text: str, rules: Rules) -> str:
    """`text` with each (pattern, replacement) applied in order, `^` and `$` at every line."""
    for pattern, replacement in rules:
        text = re.sub(pattern, replacement, text, flags=re.M)
    return text


def absolute_imports(source: str) -> Iterator[tuple[int, str]]:
    """(line, top-level name) of every absolute import in `source`, those inside functions too."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module.split(".")[0]


def relative_imports(source: str) -> Iterator[tuple[int, int, str]]:
    """(line, level, module) of every relative import in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            yield node.lineno, node.level, node.module or ""


IMPORT_STRING = re.compile(r"[A-Za-z_]\w*(\.\w+)*:[A-Za-z_]\w*")  # "package.module:attribute", as uvicorn takes one


def dynamic_imports(source: str) -> Iterator[tuple[int, str]]:
    """(line, top-level name) of every module named by a constant string: `importlib.import_module("x")`,
    `__import__("x")`, and "x.y:attr" (an app factory as uvicorn imports it in each worker)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("__import__", "import_module") \
                    or isinstance(f, ast.Attribute) and f.attr == "import_module":
                yield node.lineno, node.args[0].value.split(".")[0]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_STRING.fullmatch(node.value):
            yield node.lineno, node.value.split(".")[0].split(":")[0]


def staged_problems(package: Path, forbidden: Iterable[str], label: str | None = None) -> list[str]:
    """Every import in the staged `package` of a top-level name in `forbidden` (static, dynamic or an app string),
    and every relative import whose module is not inside `package` (named `label` in the message, else by its
    folder's name)."""
    forbidden = set(forbidden)
    problems = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        where = path.relative_to(package.parent)
        problems += [f"{where}:{line} imports {name}"
                     for line, name in [*absolute_imports(source), *dynamic_imports(source)] if name in forbidden]
        for line, level, module in relative_imports(source):
            base = path.parents[level - 1]
            target = base.joinpath(*module.split(".")) if module else base
            if not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()) \
                    or package not in (target, *target.parents):
                problems.append(f"{where}:{line} imports {'.' * level}{module}, which is not in the "
                                f"{label or package.name} package")
    return problems


def copy_package(src: Path, dst: Path, rules: Rules, left_out: Iterable[str] = ()) -> None:
    """`src` (a folder of the repository) as `dst`: its `.py` files with `rules` applied, every other file (a
    gateway's static page) as it is; `left_out` (paths relative to `src`), caches and compiled files not."""
    rules, left_out = list(rules), set(left_out)
    shutil.rmtree(dst, ignore_errors=True)
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if not path.is_file() or rel.as_posix() in left_out or "__pycache__" in rel.parts \
                or path.suffix in (".pyc", ".pyo"):
            continue
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".py":
            out.write_text(rewrite(path.read_text(encoding="utf-8"), rules), encoding="utf-8")
        else:
            shutil.copyfile(path, out)
