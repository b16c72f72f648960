"""tools.bundle: the offline bundle for a GPU host without a package index. Nothing here downloads: the pins
against this environment, stored wheels against pip, install.sh against bash and pip on stand-in wheels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from tools import bundle


def _wheel(folder: Path, name: str, version: str, files: dict) -> Path:
    """A pure-python wheel as build tools write it: deflated members, dist-info last."""
    info = f"{name}-{version}.dist-info"
    members = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
               f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    members[f"{info}/RECORD"] = "".join(f"{m},,\n" for m in members) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, text in members.items():
            zf.writestr(member, text)
    return path


def test_bundle_pins_match_the_tested_environment():
    """The offline bundle ships exactly the versions this suite runs with."""
    from importlib import metadata

    pins = list(bundle.PACKAGES) + [(n, v) for group in bundle.IF_MISSING_GROUPS.values() for n, v, _ in group]
    pins.append(bundle.STUB_NUMPY)
    checked = 0
    for name, version in pins:
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        assert installed == version, f"tools.bundle pins {name}=={version}, the test environment has {installed}"
        checked += 1
    assert checked >= len(pins) - 2


def test_gateway_group_is_default_without_pyav_and_checked_at_install():
    """`make bundle` carries what python -m gateway and bench.gateway import (not PyAV: 36 MB), and install.sh
    imports them on the host."""
    gateway = {module for _, _, module in bundle.IF_MISSING_GROUPS["gateway"]}
    assert "gateway" in bundle.DEFAULT_GROUPS and "av" not in gateway
    assert {"fastapi", "pydantic", "uvicorn", "httptools", "soundfile", "prometheus_client", "aiohttp"} <= gateway
    assert set(bundle.GATEWAY_IMPORTS) <= gateway


def test_stored_wheel_has_the_same_members_and_pip_installs_it(tmp_path):
    src = _wheel(tmp_path, "gwfake", "1.0", {"gwfake/__init__.py": "VALUE = 42\n" * 50})
    (tmp_path / "stored").mkdir()
    stored = bundle.store_wheel(src, tmp_path / "stored" / src.name)
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(stored) as b:
        assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
        assert all(a.read(n) == b.read(n) for n in a.namelist())
        assert {i.compress_type for i in b.infolist()} == {zipfile.ZIP_STORED}
    assert stored.stat().st_size > src.stat().st_size
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--disable-pip-version-check",
                    "--target", str(tmp_path / "site"), str(stored)], check=True)
    assert (tmp_path / "site" / "gwfake" / "__init__.py").read_text() == "VALUE = 42\n" * 50


def test_bundle_install_script_is_complete_bash(tmp_path):
    wheels = {"gevent": tmp_path / "gevent-26.9.0-cp312-cp312-manylinux_2_28_x86_64.whl"}
    script = bundle.write_install_sh(tmp_path, "3.12", wheels, imports=("fastapi",))
    text = script.read_text()
    assert not re.search(r"@[A-Z_]+@", text)  # every placeholder filled
    assert "gevent-26.9.0-cp312-cp312-manylinux_2_28_x86_64.whl:gevent" in text and "('fastapi',)" in text
    assert "--no-index --no-deps" in text and "export TRITONSERVER=" in text
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_install_script_installs_what_the_host_lacks_or_has_older(tmp_path):
    """install.sh on stand-in tars with this interpreter as the host: the always-wheels go in; of the if-missing
    ones, a module the host lacks and one it has older go in, one it has newer stays the host's; the last check imports
    `alone` each in a fresh process."""
    import typing_extensions  # noqa: F401  the host's (this environment's) copy: older than 99.0

    out = tmp_path / "bundle"
    (out / "w").mkdir(parents=True)
    always = _wheel(out / "w", "gwalways", "1.0", {"gwalways/__init__.py": ""})
    alone = _wheel(out / "w", "gwalone", "1.0",
                   {"gwalone/__init__.py": "import sys\nassert 'ssl' not in sys.modules\n"})
    missing = _wheel(out / "w", "gwmissing", "1.0", {"gwmissing/__init__.py": ""})
    older = _wheel(out / "w", "typing_extensions", "99.0", {"typing_extensions.py": "NEWER = True\n"})
    newer = _wheel(out / "w", "click", "0.1", {"click/__init__.py": "OLDER = True\n"})
    bundle.write_wheels_tar_xz([always, alone], "wheels", out / "wheels.tar.xz")
    bundle.write_wheels_tar_xz([missing, older, newer], "wheels-if-missing", out / "wheels-if-missing.tar.xz")
    for name in ("tritonserver", "perf-analyzer"):  # stand-ins: the server's check only warns
        with tarfile.open(out / f"{name}.tar.xz", "w:xz"):
            pass
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    script = bundle.write_install_sh(out, python, {"gwmissing": missing, "typing_extensions": older, "click": newer},
                                     imports=("gwalways", "gwmissing", "ssl"), alone=("gwalone", "gwnothere"))
    site = tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable, "SITE": str(site), "STUB_SITE": str(tmp_path / "stub"),
           "TRITON_DIR": str(tmp_path / "triton")}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr + run.stdout
    log = run.stdout + run.stderr
    assert (site / "gwalways" / "__init__.py").is_file() and (site / "gwmissing" / "__init__.py").is_file()
    assert (site / "typing_extensions.py").read_text() == "NEWER = True\n"
    assert not (site / "click").exists()
    assert "gwmissing: missing on the host (ModuleNotFoundError)" in log
    assert re.search(r"typing_extensions: the host has typing_extensions [\d.]+, older than 99\.0, installing", log)
    assert re.search(r"click: the host's click [\d.]+ is used", log)
    assert "ok      gwalways" in log and "ok      gwmissing" in log
    # imported in a fresh process, as Locust must be (its gevent patching fails once ssl is imported)
    assert "ok      gwalone" in log and "MISSING gwnothere: ModuleNotFoundError: No module named 'gwnothere'" in log


def test_elf_reader_finds_the_servers_bundled_libraries():
    root = bundle.wheel_server_root()
    needed = bundle.elf_needed(root / "bin" / "tritonserver")
    assert any(n.startswith("libtritonserver-") for n in needed) and "libc.so.6" in needed
    libs = bundle.needed_bundled_libs([root / "bin" / "tritonserver"], root.parent.parent / "nvidia_pytriton.libs")
    assert not any(n.startswith("libpython3") for n in libs)  # only the 3.13 stub needs that one


def test_locust_group_carries_what_locust_needs_beside_the_hosts_own():
    """Every distribution Locust needs on Linux (its requirements, and theirs, as this environment's metadata says) is
    in the locust or http group or named in LOCUST_NOT_CARRIED; install.sh imports Locust where the group travels."""
    from importlib import metadata

    from packaging.requirements import Requirement

    def norm(name):
        return re.sub(r"[-_.]+", "-", name).lower()
    carried = {norm(n) for g in ("locust", "http") for n, _, _ in bundle.IF_MISSING_GROUPS[g]}
    not_carried = {norm(n) for n in bundle.LOCUST_NOT_CARRIED}
    assert "locust" in bundle.DEFAULT_GROUPS and bundle.GROUP_NEEDS["locust"] == ("http",)
    assert not carried & not_carried
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}
    todo, seen, gaps = ["locust"], set(), []
    while todo:
        name = todo.pop()
        if name in seen or name in not_carried:
            continue
        seen.add(name)
        if name not in carried:
            gaps.append(name)
            continue
        for text in metadata.distribution(name).requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(norm(req.name))
    assert not gaps, f"Locust needs {gaps}: carry them in the locust group or say why not in LOCUST_NOT_CARRIED"
    locust_modules = {module for _, _, module in bundle.IF_MISSING_GROUPS["locust"]}
    assert {m.split(".")[0] for m in bundle.LOCUST_IMPORTS} <= locust_modules


def test_leaving_http_out_leaves_locust_out_and_says_so():
    said = []
    assert bundle.select_groups(list(bundle.DEFAULT_GROUPS), {"http"}, said.append) == ["gateway"]
    assert said == ["note: leaving the locust group out too: it needs http"]
    assert bundle.select_groups([*bundle.DEFAULT_GROUPS, "grpc", "http"], {"gateway"},
                                said.append) == ["http", "locust", "grpc"]
    assert len(said) == 1
