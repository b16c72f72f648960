"""The package's wings are layers and imports only point down (`chattts_triton/__init__.py` draws them):
ground (config, memory) < model < runtime < triton < launcher, and the top-level command paths above all.
Imports are read with `ast`, those inside functions too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "chattts_triton"
RANK = {"ground": 0, "model": 1, "runtime": 2, "triton": 3, "launcher": 4, "face": 5}
# the paths of the commands (python -m chattts_triton.serve | repo_config | voices | lexicon) and of the adapter that
# repositories exported before the wings import (chattts_triton.backend): nothing of the package imports them
FACES = {"serve", "repo_config", "voices", "lexicon", "backend"}
CONFIG_WRITER = {"chattts_triton.triton.repo_config", "chattts_triton.triton.params",
                 "chattts_triton.triton.deployment"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "ground"  # the package's own __init__: a docstring
    if len(parts) == 2:
        return "face" if parts[1] in FACES else "ground"
    return parts[1]


def imports(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """(line, module) of every import of a `chattts_triton` module in `path`; `from X import name` counts as X.name
    where that is a module of the package, else as X."""
    me = module_name(path, root)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            targets = [f"{base}.{a.name}" if (root / Path(*f"{base}.{a.name}".split("."))).with_suffix(".py").is_file()
                       or (root / Path(*f"{base}.{a.name}".split("."))).is_dir() else base for a in node.names]
        else:
            continue
        for t in dict.fromkeys(targets):
            if t == "chattts_triton" or t.startswith("chattts_triton."):
                yield node.lineno, t


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted((root / "chattts_triton").rglob("*.py")):
        me = module_name(path, root)
        for line, target in imports(path, root):
            where = f"{path.relative_to(root)}:{line} imports {target}"
            mine, theirs = layer(me), layer(target)
            if RANK[theirs] > RANK[mine]:
                out.append(f"{where}: {mine} below {theirs}")
            elif theirs == "face" and not target.startswith(me):
                out.append(f"{where}: a command's path, not the code (import the wing)")
            elif me in CONFIG_WRITER and theirs == "runtime":
                out.append(f"{where}: the config writer never needs the runtime")
            elif mine == "launcher" and theirs not in ("ground", "launcher"):
                out.append(f"{where}: the launcher runs Triton, not the models' code")
    return out


def test_no_import_points_up_a_layer():
    assert violations() == []


def test_the_layer_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The check itself: an upward import, written the ways the package writes imports, is caught."""
    pkg = tmp_path / "chattts_triton"
    for wing in ("model", "runtime", "triton", "launcher"):
        (pkg / wing).mkdir(parents=True)
        (pkg / wing / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("X = 1\n")
    (pkg / "serve.py").write_text("from .launcher.serve import main\n")
    (pkg / "launcher" / "serve.py").write_text("from ..config import X\n\ndef main():\n    pass\n")
    (pkg / "model" / "gpt.py").write_text("def f():\n    from ..runtime import engine\n")
    (pkg / "runtime" / "engine.py").write_text("from chattts_triton.launcher.serve import main\nfrom ..model import "
                                               "gpt\n")
    (pkg / "triton" / "repo_config.py").write_text("import chattts_triton.runtime.engine\n")
    (pkg / "triton" / "backend.py").write_text("from .. import serve\nfrom ..runtime.engine import x\n")
    found = violations(tmp_path)
    assert [v.split(" imports ")[0] for v in found] == [
        "chattts_triton/model/gpt.py:2", "chattts_triton/runtime/engine.py:1", "chattts_triton/triton/backend.py:1",
        "chattts_triton/triton/repo_config.py:1"], found


def test_the_commands_and_the_adapter_keep_their_paths():
    """`python -m chattts_triton.serve | repo_config | voices` (the image's, the chart's and the Makefile's commands)
    and `chattts_triton.backend`, which the model.py of repositories exported before the wings import."""
    import subprocess
    import sys

    from chattts_triton import backend
    from chattts_triton.triton import backend as adapter

    for name in ("make_model", "preprocess_service", "gpt_service", "vocoder_service", "stream_service"):
        assert getattr(backend, name) is getattr(adapter, name)
    for command in ("serve", "repo_config", "voices"):
        run = subprocess.run([sys.executable, "-m", f"chattts_triton.{command}", "--help"], cwd=ROOT,
                             capture_output=True,
                             text=True, timeout=120)
        assert (run.returncode == 0
                and f"python -m chattts_triton.{command}" in run.stdout), (command, run.stderr[-2000:])


# The client (client/, shipped alone as `chattts_client` by packaging/client) runs where only numpy and tritonclient
# are installed: no torch, no server modules. Of the server package it reads the two modules that
# packaging/client/setup.py copies into it, both plain Python.
CLIENT_MAY_IMPORT = {"chattts_triton.config", "chattts_triton.model.split"}
CLIENT_LEFT_OUT = {"demo.py"}  # python -m client.demo exports and starts a server: not in the client package
NOT_IN_THE_CLIENT = {"torch", "torchaudio", "tokenizers", "safetensors", "export", "gateway", "loadtest", "bench",
                     "tools", "tests", "fastapi", "av"}
# and what else only the server and gateway extras install (pyproject.toml), by import name
NOT_IN_THE_CLIENT |= {"pybase16384", "wetext", "num2words", "defusedxml", "ahocorasick", "redis", "psycopg",
                      "onnxruntime", "triton_python_backend_utils", "starlette", "pydantic", "multipart",
                      "python_multipart", "uvicorn", "httptools", "websockets", "soundfile", "soxr",
                      "prometheus_client", "wyoming"}


def dynamic_imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every `importlib.import_module("x")` or `__import__("x")` of a constant name in `path`."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            continue
        f = node.func
        if (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")
                or isinstance(f, ast.Attribute) and f.attr == "import_module"):
            yield node.lineno, node.args[0].value


def client_violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted((root / "client").rglob("*.py")):
        if path.relative_to(root / "client").as_posix() in CLIENT_LEFT_OUT:
            continue
        where = path.relative_to(root)
        dynamic = list(dynamic_imports(path))
        server = [(line, t) for line, t in dynamic if t == "chattts_triton" or t.startswith("chattts_triton.")]
        for line, target in [*imports(path, root), *server]:
            if target not in CLIENT_MAY_IMPORT:
                out.append(f"{where}:{line} imports {target}: the client package carries only "
                           f"{sorted(CLIENT_MAY_IMPORT)}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            out.extend(f"{where}:{node.lineno} imports {n}: not installed with the client" for n in names
                       if n.split(".")[0] in NOT_IN_THE_CLIENT)
        out.extend(f"{where}:{line} imports {n}: not installed with the client" for line, n in dynamic
                   if n.split(".")[0] in NOT_IN_THE_CLIENT)
    return out


def test_the_client_imports_neither_torch_nor_the_server():
    assert client_violations() == []


def test_the_client_check_sees_torch_and_server_imports(tmp_path):
    for module in ("config", "model/split", "runtime/engine", "triton/params"):
        (tmp_path / "chattts_triton" / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "chattts_triton" / f"{module}.py").write_text("")
    client = tmp_path / "client"
    client.mkdir()
    (client / "__init__.py").write_text("from .audio import x\n")
    (client / "audio.py").write_text("import numpy as np\nfrom chattts_triton.config import SAMPLE_RATE\n"
                                     "from chattts_triton.model.split import split_spans\n\n"
                                     "def f():\n    import torch\n    from chattts_triton.runtime import engine\n")
    (client / "contract.py").write_text("from chattts_triton import config as C\nfrom chattts_triton.triton import "
                                        "params\n"
                                        "from gateway.audio import encode\n")
    (client / "demo.py").write_text("from chattts_triton.launcher.tritonserver import TritonServer\n")
    found = client_violations(tmp_path)
    assert [v.split(": ")[0] for v in found] == [
        "client/audio.py:7 imports chattts_triton.runtime.engine", "client/audio.py:6 imports torch",
        "client/contract.py:2 imports chattts_triton.triton.params",
        "client/contract.py:3 imports gateway.audio"], found


def test_the_client_check_sees_server_packages_dynamic_imports_and_subpackages(tmp_path):
    """Beyond torch and the server's own modules: what only the server and gateway extras install, imports through
    importlib, and the modules of a subpackage of client/."""
    (tmp_path / "chattts_triton" / "runtime").mkdir(parents=True)
    for module in ("config", "runtime/engine"):
        (tmp_path / "chattts_triton" / f"{module}.py").write_text("")
    client = tmp_path / "client"
    (client / "extra").mkdir(parents=True)
    (client / "__init__.py").write_text("")
    (client / "audio.py").write_text("import importlib\nimport numpy as np\n\n"
                                     "def f():\n    return importlib.import_module('soundfile')\n")
    (client / "extra" / "__init__.py").write_text("")
    (client / "extra" / "serve.py").write_text("import uvicorn\nfrom importlib import import_module\n"
                                               "engine = import_module('chattts_triton.runtime.engine')\n"
                                               "config = __import__('chattts_triton.config')\n")
    found = client_violations(tmp_path)
    assert [v.split(": ")[0] for v in found] == [
        "client/audio.py:5 imports soundfile", "client/extra/serve.py:3 imports chattts_triton.runtime.engine",
        "client/extra/serve.py:1 imports uvicorn"], found


def test_the_client_imports_without_torch():
    """Imported with torch made unimportable: no module of the server beyond the two the client package carries."""
    import json
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import client, client.cli, client.realtime, client.balancer, client.audio\n"
            "import json; print(json.dumps(sorted(m for m in sys.modules if m.startswith('chattts_triton'))))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    loaded = set(json.loads(run.stdout))
    assert loaded <= CLIENT_MAY_IMPORT | {"chattts_triton", "chattts_triton.model"}, loaded


# No module imports another's private names (`from x import _y`, x a module of the project): a name shared across
# modules is public. The exceptions, each with its reason (importing file, "module._name"):
WHITE_BOX = "a white-box test of that module's own internals"
PRIVATE_IMPORTS_ALLOWED = {
    ("tests/test_split.py", "chattts_triton.model.split._NUMBER"): WHITE_BOX,
    ("tests/test_split.py", "chattts_triton.model.split._TOKEN"): WHITE_BOX,
    ("tests/test_streaming.py", "chattts_triton.runtime.streaming._Stream"): WHITE_BOX,
    ("tests/test_probes.py", "bench.probes.aoti._child_output"): WHITE_BOX,
    ("tests/test_probes.py", "bench.probes.aoti._signal_name"): WHITE_BOX,
    ("tests/test_loadtest.py", "loadtest.sweep._Step"): WHITE_BOX,
    ("tests/test_spoken.py", "chattts_triton.model.spoken._PHONE"): WHITE_BOX,
    ("tests/test_spoken.py", "chattts_triton.model.spoken._UNIT"): WHITE_BOX,
    ("tests/test_spoken.py", "chattts_triton.model.spoken._phone_spans"): WHITE_BOX,
    ("tests/test_spoken.py", "chattts_triton.model.spoken._windows"): WHITE_BOX,
}
PROJECT = ("chattts_triton", "client", "gateway", "export", "loadtest", "bench", "tools", "tests", "model_repository")


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def private_imports(root: Path = ROOT) -> Iterator[tuple[str, int, str]]:
    """(file, line, "module._name") of every `from module import _name` in the project's Python files where module,
    absolute or relative, is one of the project's, and of every `module._name` read through a name an import bound to
    such a module (`import chattts_triton.model.mix as m; m._x`, `from ..model import mix; mix._x`); inside
    functions too."""
    for top in PROJECT:
        for path in sorted((root / top).rglob("*.py")) if (root / top).is_dir() else ():
            rel = path.relative_to(root)
            if "results" in rel.parts[:2]:  # bench/results: measurements, not code
                continue
            me = module_name(path, root).split(".")
            package = me if path.name == "__init__.py" else me[:-1]
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module or ""
                if base.split(".")[0] not in PROJECT:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        yield rel.as_posix(), node.lineno, f"{base}.{alias.name}"
            yield from _private_attributes(path, rel, package, root)


def _is_module(dotted: str, root: Path) -> bool:
    where = root / Path(*dotted.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _private_attributes(path: Path, rel: Path, package: list[str], root: Path) -> Iterator[tuple[str, int, str]]:
    """`module._name` read in `path` through a name bound by an import to one of the project's modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: dict[str, str] = {}  # local name -> the module (or package prefix) it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PROJECT:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            if base.split(".")[0] in PROJECT:
                for a in node.names:
                    if _is_module(f"{base}.{a.name}", root):
                        bound[a.asname or a.name] = f"{base}.{a.name}"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        dotted = _dotted(node.value)
        if dotted is None or dotted.split(".")[0] not in bound:
            continue
        head, _, rest = dotted.partition(".")
        module = bound[head] + (f".{rest}" if rest else "")
        if _is_module(module, root):
            yield rel.as_posix(), node.lineno, f"{module}.{node.attr}"


def private_import_violations(root: Path = ROOT, allowed=None) -> list[str]:
    allowed = PRIVATE_IMPORTS_ALLOWED if allowed is None else allowed
    return [f"{path}:{line} imports {name}: private to its module (make it public, or list it with a reason)"
            for path, line, name in private_imports(root) if (path, name) not in allowed]


def test_no_private_name_is_imported_across_modules():
    assert private_import_violations() == []


def test_every_allowed_private_import_still_exists():
    """An entry whose import is gone (made public, moved) leaves the list, so that it stays the list of debts."""
    found = {(path, name) for path, _, name in private_imports()}
    gone = sorted(set(PRIVATE_IMPORTS_ALLOWED) - found)
    assert gone == [], f"no longer imported: remove from PRIVATE_IMPORTS_ALLOWED {gone}"
    assert all(reason.strip() for reason in PRIVATE_IMPORTS_ALLOWED.values())


def test_the_private_import_check_sees_absolute_relative_and_local_imports(tmp_path):
    pkg = tmp_path / "chattts_triton"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("from .engine import _Slot\n")
    (pkg / "runtime" / "engine.py").write_text("import numpy as np\nfrom numpy import _globals\n"
                                               "from ..config import LIMITS\n"
                                               "from .request import __all__, _Slot, Public\n")
    (pkg / "runtime" / "kv.py").write_text("def f():\n    from chattts_triton.runtime.request import _check\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_kv.py").write_text("from tests.conftest import _export\nfrom chattts_triton.runtime "
                                                   "import kv\n")
    found = private_import_violations(tmp_path, allowed={("tests/test_kv.py", "tests.conftest._export"): "a reason"})
    assert [v.split(": ")[0] for v in found] == [
        "chattts_triton/runtime/__init__.py:1 imports chattts_triton.runtime.engine._Slot",
        "chattts_triton/runtime/engine.py:4 imports chattts_triton.runtime.request._Slot",
        "chattts_triton/runtime/kv.py:2 imports chattts_triton.runtime.request._check"], found


def test_the_private_import_check_sees_private_names_read_through_an_imported_module(tmp_path):
    """`module._name` is an import of `_name` as much as `from module import _name` is; a name of an object's own
    (`self._x`, `np._x`) or of a class is not the check's."""
    pkg = tmp_path / "chattts_triton"
    (pkg / "model").mkdir(parents=True)
    (pkg / "runtime").mkdir()
    for init in (pkg, pkg / "model", pkg / "runtime"):
        (init / "__init__.py").write_text("")
    (pkg / "model" / "mix.py").write_text("def _shown(x):\n    return x\n\nclass Mix:\n    _cache = {}\n")
    (pkg / "runtime" / "voices.py").write_text(
        "import numpy as np\nimport chattts_triton.model.mix\nfrom ..model import mix as voice_mix\n"
        "from ..model.mix import Mix\n\n"
        "def f(self):\n    return voice_mix._shown(1), np._x, self._y, Mix._cache\n\n"
        "def g():\n    return chattts_triton.model.mix._shown(2)\n")
    found = private_import_violations(tmp_path, allowed={})
    assert sorted(v.split(": ")[0] for v in found) == [
        "chattts_triton/runtime/voices.py:10 imports chattts_triton.model.mix._shown",
        "chattts_triton/runtime/voices.py:7 imports chattts_triton.model.mix._shown"], found
