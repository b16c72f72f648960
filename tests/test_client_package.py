"""The client distribution (`packaging/client`, import name `chattts_client`): its wheel is built from the repository,
installed into a clean venv that has only numpy, tritonclient[grpc,http] and their dependencies (no torch, no server,
no package index: those wheels are packed here from this interpreter's installed copies), and synthesises against the
tiny server over gRPC and HTTP, whole and streamed, sync, asyncio and balanced, and through its command line."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import wave
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest

from chattts_triton.config import SAMPLE_RATE, samples_for_codes

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "packaging" / "client"
TOKENS = 20
CLIENT_DIST = "chattts-triton-client"


def _load(path: Path, name: str) -> dict:
    """The names of the Python file at `path` (a setup.py: its helpers, without running setup())."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _load_setup():
    """packaging/client/setup.py's helpers, without running setup()."""
    return _load(PROJECT / "setup.py", "chattts_client_setup")


def _load_staging():
    """packaging/staging.py: the copying, rewriting and checking both distributions' builds share."""
    return _load(ROOT / "packaging" / "staging.py", "chattts_triton_staging")


def test_the_staged_package_imports_neither_the_server_nor_torch(tmp_path):
    setup = _load_setup()
    package = setup["stage"](ROOT, tmp_path)
    names = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py"))
    assert names == ["__init__.py", "__main__.py", "_shared/__init__.py", "_shared/config.py", "_shared/split.py",
                     "audio.py", "balancer.py", "cli.py", "client.py", "contract.py", "errors.py", "realtime.py",
                     "transport.py"]
    for path in package.rglob("*.py"):
        for _, name in _load_staging()["absolute_imports"](path.read_text(encoding="utf-8")):
            assert name in sys.stdlib_module_names or name in {"numpy", "tritonclient", "grpc", "urllib3", "aiohttp",
                                                                "tqdm"}, (path, name)


def test_the_staging_check_refuses_a_server_import(tmp_path):
    setup = _load_setup()
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "client", root / "client")
    (root / "chattts_triton" / "model").mkdir(parents=True)
    shutil.copyfile(ROOT / "chattts_triton" / "config.py", root / "chattts_triton" / "config.py")
    shutil.copyfile(ROOT / "chattts_triton" / "model" / "split.py", root / "chattts_triton" / "model" / "split.py")
    (root / "client" / "errors.py").write_text("def f():\n    from chattts_triton.runtime import engine\n",
                                               encoding="utf-8")
    with pytest.raises(SystemExit, match=r"errors.py:2 imports chattts_triton"):
        setup["stage"](root, tmp_path / "out")
    (root / "client" / "errors.py").write_text("X = 1\n", encoding="utf-8")
    (root / "chattts_triton" / "config.py").write_text("from .deployment import Deployment\n", encoding="utf-8")
    with pytest.raises(SystemExit,
                       match=r"_shared/config.py:1 imports .deployment, which is not in the client package"):
        setup["stage"](root, tmp_path / "out")


def _pyproject(path: Path) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads(path.read_text(encoding="utf-8"))


def test_the_client_version_is_the_projects():
    assert (_pyproject(PROJECT / "pyproject.toml")["project"]["version"]
            == _pyproject(ROOT / "pyproject.toml")["project"]["version"])


def test_the_server_distribution_installs_no_bench_or_loadtest_and_keeps_torch_behind_an_extra():
    pyproject = _pyproject(ROOT / "pyproject.toml")
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [p for p in include if p.startswith(("bench", "loadtest", "tests", "tools"))], include
    project = pyproject["project"]
    assert project["dependencies"] == ["numpy", "tritonclient[grpc,http]"]
    assert "torch" in project["optional-dependencies"]["server"]
    for extra in ("export", "gateway"):
        assert "chattts-triton[server]" in project["optional-dependencies"][extra]


# --- the wheel in a clean venv ----------------------------------------------------------------------------------------


def requirement_closure(requirements: Iterable[str]) -> dict[str, md.Distribution]:
    """The installed distributions that `requirements` need, by canonical name, markers evaluated for this
    interpreter."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, md.Distribution] = {}
    done = set()
    todo = [(r, "") for r in requirements]
    while todo:
        text, extra = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        dist = found.get(name) or md.distribution(req.name)
        assert req.specifier.contains(dist.version, prereleases=True), (text, dist.version)
        found[name] = dist
        for want in ("", *sorted(req.extras)):
            if (name, want) not in done:
                done.add((name, want))
                todo.extend((r, want) for r in dist.requires or [])
    return found


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(dist: md.Distribution, out: Path) -> Path:
    """`dist` as installed here, written back into a wheel (stored, not compressed: built for one install). Files
    outside site-packages (console scripts, which pip writes again from entry_points.txt) are left out."""
    metadata = next(f for f in dist.files if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))
    info_dir = Path(dist.locate_file(metadata)).parent
    site = info_dir.parent
    tags = [line.split(":", 1)[1].strip() for line in (info_dir / "WHEEL").read_text().splitlines()
            if line.startswith("Tag:")]
    parts = [sorted({t.split("-")[i] for t in tags}) for i in range(3)]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    path = out / f"{name}-{dist.version}-{'-'.join('.'.join(p) for p in parts)}.whl"
    skip = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    rows: list[list[str]] = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as whl:
        for file in dist.files:
            src = Path(dist.locate_file(file)).resolve()
            arc = src.relative_to(site.resolve()).as_posix() if src.is_relative_to(site.resolve()) else None
            if arc is None or "__pycache__" in src.parts or not src.is_file() or (src.parent == info_dir.resolve()
                                                                                    and src.name in skip):
                continue
            data = src.read_bytes()
            whl.writestr(arc, data)
            rows.append([arc, _record_hash(data), str(len(data))])
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows([*rows, [f"{info_dir.name}/RECORD", "", ""]])
        whl.writestr(f"{info_dir.name}/RECORD", record.getvalue())
    return path


def _clean_env() -> dict[str, str]:
    """pip with no configuration: no index, no find-links but ours (the machine's may hold torch)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory):
    """(python, bin folder) of a fresh venv with the client wheel and nothing but what it requires."""
    work = tmp_path_factory.mktemp("client-package")
    project = work / "project"
    project.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in"):
        shutil.copyfile(PROJECT / name, project / name)
    # built as `pip install -e .` builds the project (make setup): setuptools from the configured index
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"),
                          str(project)],
                         env={**os.environ, "CHATTTS_TRITON_ROOT": str(ROOT)}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (wheel,) = (work / "dist").glob("chattts_triton_client-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "extra ==" not in r] == ["numpy", "tritonclient[grpc,http]"]
    closure = requirement_closure(requires[:2])
    assert "torch" not in closure and "chattts-triton" not in closure, sorted(closure)
    wheels = work / "wheels"
    wheels.mkdir()
    for dist in closure.values():
        repack(dist, wheels)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    run = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
                          "--no-cache-dir",
                          "--find-links", str(wheels), str(wheel)], env=_clean_env(), capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return python, venv / "bin", sorted(closure)


def _in_venv(python: Path, code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-I", "-c", code, *args], cwd=cwd, env=_clean_env(), capture_output=True,
                          text=True, timeout=300)


def test_the_client_installs_without_torch_or_the_server(client_venv, tmp_path):
    python, _, closure = client_venv
    listing = _in_venv(python, "import importlib.metadata as m, json; "
                               "print(json.dumps(sorted(d.metadata['Name'].lower() "
                               "for d in m.distributions())))", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    installed = set(json.loads(listing.stdout))
    assert "torch" not in installed and "chattts-triton" not in installed and CLIENT_DIST in installed
    def canonical(names):
        return {re.sub(r"[-_.]+", "-", n) for n in names}

    assert canonical(installed) <= canonical(closure) | {CLIENT_DIST}, canonical(installed) - canonical(closure)
    probe = _in_venv(python, "import sys, chattts_client, chattts_client.cli, chattts_client.realtime, "
                             "chattts_client.balancer\n"
                             "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'chattts_triton', "
                             "'client')]\nfor name in ('torch', 'chattts_triton', 'client'):\n"
                             "    try:\n        __import__(name)\n    except ImportError:\n        continue\n"
                             "    raise SystemExit(name + ' is importable')\n"
                             "print(chattts_client.ChatTTSClient.__name__, chattts_client.SAMPLE_RATE)", cwd=tmp_path)
    assert probe.returncode == 0 and probe.stdout.split() == ["ChatTTSClient", str(SAMPLE_RATE)], probe.stderr


SYNTHESISE = r"""
import asyncio, json, sys
from chattts_client import AsyncBalancedChatTTSClient, AsyncChatTTSClient, BalancedChatTTSClient, ChatTTSClient

grpc_url, http_url, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
fixed = dict(seed=1, max_new_tokens=tokens, min_new_tokens=tokens)
sizes = {}
for protocol, url in (("grpc", grpc_url), ("http", http_url)):
    with ChatTTSClient(url, protocol=protocol) as tts:
        sizes[protocol] = int(tts.synthesize("Hello world.", **fixed).size)
        sizes[protocol + " stream"] = sum(int(c.size) for c in tts.stream("Hello world.", **fixed))
with BalancedChatTTSClient([http_url, http_url.replace("127.0.0.1", "localhost")], protocol="http") as tts:
    sizes["balanced"] = int(tts.synthesize("Hello world.", **fixed).size)


async def main():
    async with AsyncChatTTSClient(grpc_url, protocol="grpc") as tts:
        sizes["async"] = int((await tts.synthesize("Hello world.", **fixed)).size)
        chunks = [c async for c in tts.stream("Hello world.", **fixed)]
        sizes["async stream"] = sum(int(c.size) for c in chunks)
    async with AsyncBalancedChatTTSClient([grpc_url]) as tts:
        sizes["async balanced"] = int((await tts.synthesize("Hello world.", **fixed)).size)

asyncio.run(main())
assert "torch" not in sys.modules
print(json.dumps(sizes))
"""


@pytest.mark.e2e
def test_the_installed_client_synthesises_against_the_server(client_venv, served_tiny, tmp_path):
    python, bin_dir, _ = client_venv
    run = _in_venv(python, SYNTHESISE, served_tiny.grpc_url, served_tiny.http_url, str(TOKENS), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    sizes = json.loads(run.stdout)
    assert set(sizes) == {"grpc", "http", "grpc stream", "http stream", "balanced", "async", "async stream",
                          "async balanced"}
    # one seed, MIN = MAX new tokens: every path returns the same length
    assert len(set(sizes.values())) == 1 and 0 < sizes["grpc"] <= samples_for_codes(TOKENS), sizes
    out = tmp_path / "hello.wav"
    cli = subprocess.run([str(bin_dir / "chattts-client"), "Hello world.", "-o", str(out), "--url",
                          served_tiny.grpc_url,
                          "--seed", "1", "--max-new-tokens", str(TOKENS), "--min-new-tokens", str(TOKENS)],
                         cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    with wave.open(str(out)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (1, SAMPLE_RATE, sizes["grpc"])


# --- the project's own wheel (chattts-triton): one top-level name --------------------------------------------------

# what setup.py and MANIFEST.in build the project's sdist and wheel from
PROJECT_SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "chattts_triton", "client", "export",
                   "gateway", "model_repository", "packaging/staging.py")
STAGED = {"client": {"demo.py"}, "export": set(), "gateway": set()}  # folder -> what the wheel leaves out
REPOSITORY_FOLDERS = ("client", "export", "gateway", "bench", "loadtest", "tools", "tests")


def _load_project_setup():
    """The root setup.py's helpers, without running setup()."""
    return _load(ROOT / "setup.py", "chattts_triton_setup")


@pytest.fixture(scope="module")
def project_wheel(tmp_path_factory) -> Path:
    """chattts-triton's wheel, built as pip builds a release: an sdist of a copy of the sources, then the wheel from
    the sdist (setuptools from the configured index, as `pip install .` takes it); nothing written into the
    repository."""
    work = tmp_path_factory.mktemp("project-package")
    project = work / "project"
    for name in PROJECT_SOURCES:
        src, dst = ROOT / name, project / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.py[co]"))
        else:
            shutil.copyfile(src, dst)
    sdist = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "build_meta.build_sdist(sys.argv[1])", str(work / "sdist")],
                           cwd=project, capture_output=True, text=True, timeout=300)
    assert sdist.returncode == 0, sdist.stdout[-3000:] + sdist.stderr[-3000:]
    (archive,) = (work / "sdist").glob("*.tar.gz")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"),
                          str(archive)], cwd=work, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (wheel,) = (work / "dist").glob("chattts_triton-*.whl")
    return wheel


@pytest.fixture(scope="module")
def project_unpacked(project_wheel, tmp_path_factory) -> Path:
    """The wheel's files, as pip lays them into site-packages."""
    out = tmp_path_factory.mktemp("project-site")
    with zipfile.ZipFile(project_wheel) as z:
        z.extractall(out)
    return out


def test_the_project_wheel_installs_chattts_triton_alone(project_wheel):
    """No `client`, `export`, `gateway`, `bench` or `loadtest` beside it: the repository's command folders are
    inside it, each with the modules of its folder (the client less demo.py, as the client's own distribution)."""
    assert _pyproject(ROOT / "pyproject.toml")["tool"]["setuptools"]["packages"]["find"]["include"] == [
        "chattts_triton*"]
    with zipfile.ZipFile(project_wheel) as z:
        names = z.namelist()
        top_level = z.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    assert {n.split("/")[0] for n in names} == {"chattts_triton", "chattts_triton-0.2.0.dist-info"}, sorted(
        {n.split("/")[0] for n in names})
    assert top_level == ["chattts_triton"]
    for folder, left_out in STAGED.items():
        staged = sorted(n.removeprefix(f"chattts_triton/{folder}/") for n in names
                        if n.startswith(f"chattts_triton/{folder}/") and n.endswith(".py")
                        and "/model_repository/" not in n)
        repository = sorted(p.relative_to(ROOT / folder).as_posix() for p in (ROOT / folder).rglob("*.py")
                            if "__pycache__" not in p.parts and p.name not in left_out)
        assert staged == repository, folder
    package = [n for n in names if n.startswith("chattts_triton/") and n.endswith(".py")
               and not n.startswith(tuple(f"chattts_triton/{f}/" for f in STAGED))]
    assert sorted(package) == sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "chattts_triton").rglob("*.py")
                                     if "__pycache__" not in p.parts)


def test_the_staged_folders_import_none_of_the_repositorys_folders(project_unpacked):
    """Every import of the staged modules, those inside functions, through importlib and the app string uvicorn's
    workers import, names `chattts_triton.client`/`.export`/`.gateway`, never the repository's top-level folders."""
    staging = _load_staging()
    for folder in STAGED:
        package = project_unpacked / "chattts_triton" / folder
        for path in sorted(package.rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            for line, name in [*staging["absolute_imports"](source), *staging["dynamic_imports"](source)]:
                assert name not in REPOSITORY_FOLDERS, f"{path.relative_to(project_unpacked)}:{line} imports {name}"
        assert staging["staged_problems"](package, REPOSITORY_FOLDERS) == []
    gateway = (project_unpacked / "chattts_triton" / "gateway" / "__main__.py").read_text(encoding="utf-8")
    assert '"chattts_triton.gateway.app:app_from_env"' in gateway and "gateway.app:" not in gateway.replace(
        "chattts_triton.gateway.app:", "")
    synth = (project_unpacked / "chattts_triton" / "gateway" / "synth.py").read_text(encoding="utf-8")
    assert "from chattts_triton.client.client import AsyncChatTTSClient" in synth


def test_the_project_wheel_carries_its_package_data(project_unpacked):
    """The text normaliser's resources, the gateway's playground and the exporter's model repository template, each
    as the repository holds it."""
    def files(folder: Path):
        return [p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts]

    wanted = {f"chattts_triton/{p.relative_to(ROOT / 'chattts_triton').as_posix()}": p
              for p in files(ROOT / "chattts_triton" / "model" / "res")}
    wanted |= {f"chattts_triton/gateway/{p.relative_to(ROOT / 'gateway').as_posix()}": p
               for p in files(ROOT / "gateway" / "static")}
    wanted |= {f"chattts_triton/export/{p.relative_to(ROOT).as_posix()}": p for p in files(ROOT / "model_repository")}
    assert {"chattts_triton/gateway/static/index.html", "chattts_triton/model/res/homophones_map.json.gz",
            "chattts_triton/export/model_repository/chattts_gpt/1/model.py"} <= set(wanted)
    missing = sorted(w for w in wanted if not (project_unpacked / w).is_file())
    assert missing == []
    assert [w for w, source in wanted.items() if (project_unpacked / w).read_bytes() != source.read_bytes()] == []


RUN_STAGED = r"""
import contextlib, io, json, runpy, sys
site = sys.argv[1]
sys.path.insert(0, site)
for name in ("client", "export", "gateway", "bench", "loadtest", "tools", "tests"):
    sys.modules[name] = None  # an import of the repository's folders fails (the venv's editable install maps them)
import chattts_triton
import chattts_triton.export.__main__ as ex
from chattts_triton.gateway import app
out = {"package": chattts_triton.__file__, "template": str(ex.TEMPLATE), "static": str(app.STATIC)}
for module in ("chattts_triton.export", "chattts_triton.gateway", "chattts_triton.gateway.wyoming",
               "chattts_triton.client"):
    sys.argv = [module, "--help"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    out[module] = buf.getvalue().split("\n")[0]
print(json.dumps(out))
"""


def test_the_staged_commands_run_from_the_wheel(project_unpacked, tmp_path):
    """`python -m chattts_triton.export | .gateway | .gateway.wyoming | .client` from the wheel's files alone (the
    repository's folders unimportable): their help names them so; the exporter finds its template, the gateway its
    playground, inside the package."""
    run = subprocess.run([sys.executable, "-I", "-c", RUN_STAGED, str(project_unpacked)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    package = project_unpacked / "chattts_triton"
    assert Path(out["package"]) == package / "__init__.py"
    assert Path(out["template"]) == package / "export" / "model_repository"
    assert Path(out["static"]) == package / "gateway" / "static"
    for module in ("chattts_triton.export", "chattts_triton.gateway", "chattts_triton.gateway.wyoming",
                   "chattts_triton.client"):
        assert out[module].startswith(f"usage: python -m {module} "), (module, out[module])


def test_the_project_staging_rewrites_imports_and_refuses_what_it_cannot(tmp_path):
    """`from client.x import`, `from export.y import` and the uvicorn app string become the package's names; an
    import the rewrites do not reach (`import gateway.audio`, bench, an app string of loadtest) stops the build."""
    setup = _load_project_setup()
    root = tmp_path / "repo"
    for folder in ("client", "export", "gateway", "model_repository/chattts/1"):
        (root / folder).mkdir(parents=True)
    (root / "client" / "__init__.py").write_text("from client.contract import X\n")
    (root / "client" / "contract.py").write_text("X = 1\n")
    (root / "client" / "demo.py").write_text("import bench\n")  # left out: the repository's
    (root / "export" / "__init__.py").write_text("")
    (root / "export" / "__main__.py").write_text('"""python -m export"""\n\ndef f():\n    from export.codec import g\n')
    (root / "export" / "codec.py").write_text("def g():\n    pass\n")
    (root / "gateway" / "__init__.py").write_text("from .app import app\n")
    (root / "gateway" / "app.py").write_text("from client import X\nfrom client.contract import X as Y\napp = 1\n")
    (root / "gateway" / "__main__.py").write_text('import uvicorn\nuvicorn.run("gateway.app:app", factory=True)\n')
    (root / "model_repository" / "chattts" / "1" / ".keep").write_text("")
    out = tmp_path / "out" / "chattts_triton"
    staged = setup["stage"](root, out)
    assert [p.name for p in staged] == ["client", "export", "gateway"]
    assert not (out / "client" / "demo.py").exists() and (out / "export" / "model_repository" / "chattts" / "1"
                                                             / ".keep").is_file()
    assert (out / "client" / "__init__.py").read_text() == "from chattts_triton.client.contract import X\n"
    assert (out / "export" / "__main__.py").read_text() == ('"""python -m chattts_triton.export"""\n\ndef f():\n'
                                                            "    from chattts_triton.export.codec import g\n")
    assert (out / "gateway" / "app.py").read_text() == ("from chattts_triton.client import X\n"
                                                        "from chattts_triton.client.contract import X as Y\napp = 1\n")
    assert '"chattts_triton.gateway.app:app"' in (out / "gateway" / "__main__.py").read_text()
    (root / "gateway" / "audio.py").write_text("import gateway.audio\n\ndef f():\n    from bench.gateway import h\n")
    (root / "gateway" / "app.py").write_text('import importlib\napp = importlib.import_module("loadtest.app")\n'
                                             'factory = "loadtest.app:make"\n')
    with pytest.raises(SystemExit) as failed:
        setup["stage"](root, tmp_path / "again" / "chattts_triton")
    assert [line.strip() for line in str(failed.value).splitlines()[1:]] == [
        "gateway/app.py:2 imports loadtest", "gateway/app.py:3 imports loadtest", "gateway/audio.py:1 imports gateway",
        "gateway/audio.py:4 imports bench"]
