"""Pack what a GPU host without a package index needs to run our server and benchmarks.

    python -m tools.bundle OUT_DIR [--python 3.12]

The host is assumed to have Python 3.12 with torch, numpy, onnx, onnxruntime and transformers.
OUT_DIR then holds:

    wheels.tar.xz           wheels/: cp312 manylinux_x86_64 / none-any wheels of the packages it
                            lacks (PACKAGES; sdist-only ones such as chattts and encodec are built
                            into pure-python wheels here). Every wheel in the two tars is stored
                            (its members rewritten uncompressed, the same files): xz over all of
                            them packs 40 % smaller than the wheels' own deflate (13.2 → 7.5 MB)
    wheels-if-missing.tar.xz
                            wheels-if-missing/: IF_MISSING_GROUPS, each wheel installed only where
                            the host cannot import it or has an older version. By default "http"
                            (tritonclient.http's gevent stack, 4.7 MB of wheels) and "gateway" (what
                            `python -m gateway` and `python -m bench.gateway` need for wav and pcm:
                            FastAPI, uvicorn with httptools, soundfile, prometheus-client, aiohttp
                            and their dependencies, 8.7 MB; not PyAV, 36 MB: no mp3/opus/aac, no
                            wav stream) and "locust" (Locust and Flask, pyzmq, ... for loadtest.run and
                            bench.http_clients' locust path, 3.6 MB; it needs "http"): 12.0 MB in the
                            tar. --with grpc (grpcio, 7.4 MB) and --with tokenizers (tokenizers and
                            safetensors, which transformers already requires: 3.9 MB) on request;
                            --without GROUP leaves a default one out (--without http also locust)
    stub-numpy.tar.xz       numpy 1.26.4 as an installed site folder (tests removed; xz halves the
                            wheel's 18 MB), unpacked only if the host's numpy is 2.x, into a folder
                            that only the python-backend stub sees (Triton 2.51's stub silently
                            returns empty outputs with numpy 2; see chattts_triton.launcher.tritonserver)
    tritonserver.tar.xz     the server from the nvidia-pytriton wheel, in the wheel's layout:
                              pytriton/tritonserver/bin/tritonserver
                              pytriton/tritonserver/backends/python/{libtriton_python.so,
                                  triton_python_backend_utils.py, triton_python_backend_stub (3.12)}
                              pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub
                              pytriton/tritonserver/caches/local/libtritoncache_local.so
                              nvidia_pytriton.libs/*.so  (only those the binaries need)
                            binaries stripped of unneeded symbols (-2.4 MB compressed)
    perf-analyzer.tar.xz    Triton's perf_analyzer and the two libraries it links (bench/perf.py)
    install.sh              on the host: installs the wheels with
                            `pip install --no-index --no-deps --target $SITE` (those of
                            wheels-if-missing/ after checking the host's copies), unpacks the server
                            into $TRITON_DIR, checks imports and libpython, and prints the
                            environment to export (PYTHONPATH, TRITONSERVER, LD_LIBRARY_PATH,
                            CHATTTS_TRITON_STUB_PYTHONPATH)
    MANIFEST.txt            every file with its size and sha256, and every wheel in the tars with
                            its size and sha256 as downloaded from the index

`TRITONSERVER=$TRITON_DIR/pytriton/tritonserver/bin/tritonserver` makes
`chattts_triton.launcher.tritonserver` use the unpacked tree: the libraries are found at
`../../nvidia_pytriton.libs` relative to the server root, as in the wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

# (distribution, version): pinned to what the test suite runs with (requirements.txt / .venv).
PACKAGES: tuple[tuple[str, str], ...] = (
    ("chattts", "0.2.5"),
    ("vocos", "0.1.0"),
    ("vector_quantize_pytorch", "1.32.0"),
    ("einx", "0.4.3"),
    ("frozendict", "2.5.1"),
    ("loguru", "0.7.3"),
    ("torch-einops-utils", "0.2.0"),
    ("pybase16384", "0.3.9"),
    ("cffi", "2.1.1"),
    ("pycparser", "3.12"),
    ("encodec", "0.1.1"),
    ("tritonclient", "2.73.0"),
    ("python-rapidjson", "1.25"),
    ("py-spy", "0.4.3"),  # bench.probes.gil
    # the spoken-form text normaliser (chattts_triton.model.spoken) and what it needs
    ("wetext", "0.1.8"),
    ("kaldifst", "1.8.3"),
    ("contractions", "0.1.73"),
    ("textsearch", "0.0.24"),
    ("anyascii", "0.3.3"),
    ("pyahocorasick", "2.3.1"),
    ("num2words", "0.5.14"),
    ("docopt", "0.6.2"),
    ("defusedxml", "0.7.1"),  # SSML (chattts_triton.model.ssml), server and gateway
)
# (distribution, version, import name): shipped in groups, installed on the host only where the
# import fails there or the host's distribution is older (pydantic needs typing-extensions ≥ 4.16,
# newer than torch asks for; an older host copy imports but breaks it). tritonclient.http needs the
# "http" group; the host's transformers brings tokenizers/safetensors and onnx brings
# protobuf/ml_dtypes, requests brings urllib3/certifi.
IF_MISSING_GROUPS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "http": (
        ("geventhttpclient", "2.6.1", "geventhttpclient"),
        ("gevent", "26.9.0", "gevent"),
        ("greenlet", "3.3.2", "greenlet"),
        ("zope.interface", "8.7", "zope.interface"),
        ("zope.event", "6.2", "zope.event"),
        ("brotli", "1.2.1", "brotli"),
    ),
    # the speech gateway and bench.gateway's load generator, wav/pcm/flac only (PyAV, FFmpeg's 36 MB, would
    # break the size budget: mp3/opus/aac and streamed wav/flac are not served; bench.gateway says so)
    "gateway": (
        ("fastapi", "0.163.2", "fastapi"),
        ("starlette", "1.10.0", "starlette"),
        ("opentelemetry-api", "1.45.2", "opentelemetry"),  # fastapi.applications imports it
        ("pydantic", "2.14.4", "pydantic"),
        ("pydantic-core", "2.50.5", "pydantic_core"),
        ("annotated-types", "0.8.0", "annotated_types"),
        ("annotated-doc", "0.0.7", "annotated_doc"),
        ("typing-inspection", "0.4.5", "typing_inspection"),
        ("typing-extensions", "4.16.0", "typing_extensions"),
        ("anyio", "4.16.0", "anyio"),
        ("idna", "3.20", "idna"),
        ("uvicorn", "0.54.0", "uvicorn"),
        ("click", "8.5.1", "click"),
        ("h11", "0.16.0", "h11"),
        ("httptools", "0.9.0", "httptools"),  # the gateway's C HTTP parser, as deployed (h11 costs more CPU)
        # uvicorn's WebSocket protocol (the realtime path) and bench.realtime's client
        ("websockets", "17.4", "websockets"),
        ("soxr", "1.1.0", "soxr"),  # libsoxr: output rates other than 24 kHz
        ("prometheus-client", "0.26.0", "prometheus_client"),
        ("soundfile", "0.14.0", "soundfile"),  # with libsndfile; cffi is in PACKAGES
        ("aiohttp", "3.14.5", "aiohttp"),  # bench.gateway's HTTP load generator
        ("aiohappyeyeballs", "2.7.1", "aiohappyeyeballs"),
        ("aiosignal", "1.4.0", "aiosignal"),
        ("attrs", "26.1.0", "attr"),
        ("frozenlist", "1.8.0", "frozenlist"),
        ("multidict", "7.2.1", "multidict"),
        ("propcache", "0.5.4", "propcache"),
        ("yarl", "1.25.1", "yarl"),
    ),
    # Locust (loadtest.run, bench.http_clients' locust path) on top of "http"'s gevent stack: 3.6 MB of wheels,
    # 2.6 MB in the tar beside the others. Not carried (LOCUST_NOT_CARRIED): what the host's image has and what Locust
    # imports only where we never run it
    "locust": (
        ("locust", "2.47.0", "locust"),
        ("flask", "3.1.3", "flask"),  # its web UI and report.html, imported in headless runs too
        ("flask-cors", "6.0.5", "flask_cors"),
        ("flask-login", "0.6.3", "flask_login"),
        ("werkzeug", "3.1.9", "werkzeug"),  # the host has one; Flask 3.1 needs >= 3.1
        ("blinker", "1.9.0", "blinker"),
        ("itsdangerous", "2.2.0", "itsdangerous"),
        ("click", "8.5.1", "click"),  # also in "gateway": one wheel
        ("configargparse", "1.9.0", "configargparse"),
        ("pyzmq", "27.3.0", "zmq"),  # --processes: the master and its workers talk over ZeroMQ
        ("msgpack", "1.2.4", "msgpack"),
        ("psutil", "7.2.2", "psutil"),
        ("requests", "2.34.2", "requests"),  # Locust needs >= 2.33.1, newer than the host may have
    ),
    "grpc": (("grpcio", "1.85.3", "grpc"),),  # 7.4 MB
    "tokenizers": (("tokenizers", "0.23.3", "tokenizers"), ("safetensors", "0.8.0", "safetensors")),  # 3.9 MB
}
DEFAULT_GROUPS = ("http", "gateway", "locust")
# a group -> the groups it cannot work without (Locust runs on gevent)
GROUP_NEEDS: dict[str, tuple[str, ...]] = {"locust": ("http",)}
# What Locust requires (its own requirements and its group's, on Linux) that the "locust" group does not carry: the
# host's image has them (torch brings jinja2 and markupsafe, requests urllib3, certifi and charset-normalizer, and
# pytest is there), or only modules we never import need them (python-socketio and -engineio: locust.contrib.socketio;
# pytest: Locust's pytest plugin). idna and typing-extensions travel in "gateway".
LOCUST_NOT_CARRIED = ("jinja2", "markupsafe", "urllib3", "certifi", "charset-normalizer", "idna", "typing-extensions",
                      "pytest", "python-socketio", "python-engineio")
STUB_NUMPY = ("numpy", "1.26.4")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
SIZE_BUDGET_MB = 60  # with the ≈ 5-MB tree, inside the device tool's 64-MiB (67.1-MB) carry
# Modules install.sh imports to prove the host can run server, client and upstream benchmarks.
HOST_IMPORTS = (
    "torch", "numpy", "tokenizers", "safetensors", "pybase16384", "onnxruntime",
    "tritonclient.http", "tritonclient.grpc", "ChatTTS", "vocos", "vector_quantize_pytorch", "wetext", "num2words",
)
# ... and the speech gateway with bench.gateway's load generator, where the bundle carries the "gateway" group
GATEWAY_IMPORTS = ("fastapi", "uvicorn", "httptools", "websockets", "soxr", "soundfile", "prometheus_client", "aiohttp")
# ... and Locust's command line, which imports all of its group (pyzmq and msgpack for --processes, Flask), where the
# bundle carries the "locust" group: in a process of its own (importing locust patches the standard library with gevent,
# which fails once ssl is imported, as the check above has)
LOCUST_IMPORTS = ("locust.main",)


# --- wheels ------------------------------------------------------------------------------------
def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"], check=True)


def download_wheels(packages: Iterable[tuple[str, str]], dest: Path, python: str) -> list[Path]:
    """Binary wheels for CPython `python` on manylinux x86_64; sdist-only pure-python packages
    are built into none-any wheels (they install the same anywhere)."""
    dest.mkdir(parents=True, exist_ok=True)
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    for name, version in packages:
        spec = f"{name}=={version}"
        before = set(dest.glob("*.whl"))
        try:
            _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python,
                 "--implementation", "cp", *platform_args, "-d", str(dest), spec)
        except subprocess.CalledProcessError as e:
            with tempfile.TemporaryDirectory() as tmp:
                _pip("wheel", "--no-deps", "-w", tmp, spec)
                built = list(Path(tmp).glob("*.whl"))
                if len(built) != 1 or not built[0].name.endswith("-none-any.whl"):
                    raise RuntimeError(
                        f"{spec} has no {python} wheel and does not build to a pure-python one: {built}") from e
                shutil.move(str(built[0]), dest / built[0].name)
        if not (set(dest.glob("*.whl")) - before) and not _has_wheel(dest, name, version):
            raise RuntimeError(f"no wheel for {spec} ended up in {dest}")
    return sorted(dest.glob("*.whl"))


def _wheel_for(folder: Path, name: str, version: str) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", name).lower()  # wheel file names normalise the project name
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
    return found[0] if found else None


def _has_wheel(folder: Path, name: str, version: str) -> bool:
    return _wheel_for(folder, name, version) is not None


# --- server tree -------------------------------------------------------------------------------
def wheel_server_root() -> Path:
    """`pytriton/tritonserver` inside the installed nvidia-pytriton wheel (never $TRITONSERVER)."""
    import pytriton

    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise RuntimeError(f"nvidia-pytriton has no server at {root}")
    return root


def elf_needed(path: Path) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF file (what ldd would resolve)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab_offset + value)
                needed.append(data[strtab_offset + value : end].decode())
    return needed


def needed_bundled_libs(binaries: Sequence[Path], libs_dir: Path) -> set[str]:
    """Closure of the bundled libraries that `binaries` load (system libraries are left to the host)."""
    bundled = {p.name for p in libs_dir.iterdir()}
    todo, seen = [Path(b) for b in binaries], set()
    while todo:
        for dep in elf_needed(todo.pop()):
            if dep in bundled and dep not in seen:
                seen.add(dep)
                todo.append(libs_dir / dep)
    return seen


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def strip_binaries(paths: Iterable[Path]) -> bool:
    """Drop symbols the loader does not need (the dynamic symbol table stays); False without binutils."""
    strip = shutil.which("strip")
    if not strip:
        return False
    for path in paths:
        subprocess.run([strip, "--strip-unneeded", str(path)], check=True)
    return True


def assemble_server_tree(dest: Path, python_version: Sequence[int] = (3, 12), strip: bool = True) -> Path:
    """Write the server (wheel layout) for one Python version under `dest`; return the server root."""
    source = wheel_server_root()
    tag = f"{python_version[0]}.{python_version[1]}"
    stub = source / "python_backend_stubs" / tag / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton ships no python backend stub for Python {tag}")
    root = Path(dest) / "pytriton" / "tritonserver"
    if root.exists():
        shutil.rmtree(root)
    binaries = [
        source / "bin" / "tritonserver",
        source / "backends" / "python" / "libtriton_python.so",
        source / "caches" / "local" / "libtritoncache_local.so",
        stub,
    ]
    for path in binaries[:-1] + [source / "backends" / "python" / "triton_python_backend_utils.py"]:
        _copy(path, root / path.relative_to(source))
    _copy(stub, root / "python_backend_stubs" / tag / stub.name)
    libs_src = source.parent.parent / "nvidia_pytriton.libs"
    libs_dst = Path(dest) / "nvidia_pytriton.libs"
    if libs_dst.exists():
        shutil.rmtree(libs_dst)
    for name in sorted(needed_bundled_libs(binaries, libs_src)):
        _copy(libs_src / name, libs_dst / name)
    if strip:
        copies = ([root / b.relative_to(source) for b in binaries[:-1]]
                  + [root / "python_backend_stubs" / tag / stub.name])
        strip_binaries(copies + sorted(libs_dst.iterdir()))
    # Also usable as a backend directory as it is: the stub beside libtriton_python.so (a hard
    # link, stored once in the tar; made after stripping, which replaces files).
    os.link(root / "python_backend_stubs" / tag / stub.name, root / "backends" / "python" / stub.name)
    return root


def write_tar_xz(tree: Path, out: Path) -> Path:
    """Compress `tree`'s contents (hard links kept) with xz; uses all cores if the xz tool exists."""
    members = sorted(p.name for p in tree.iterdir())
    if shutil.which("xz") and shutil.which("tar"):
        env = dict(os.environ, XZ_OPT="-9 -T0")
        subprocess.run(["tar", "-C", str(tree), "--owner=0", "--group=0", "-cJf", str(out), *members],
                       check=True, env=env)
    else:
        with tarfile.open(out, "w:xz", preset=9) as tar:
            for name in members:
                tar.add(tree / name, arcname=name)
    return out


# --- install script ----------------------------------------------------------------------------
INSTALL_SH = r"""#!/usr/bin/env bash
# Offline install of the chattts-triton runtime on a GPU host (written by python -m tools.bundle).
# Override the locations with SITE=..., STUB_SITE=..., TRITON_DIR=..., PYTHON=...
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
SITE="${SITE:-/tmp/site}"
STUB_SITE="${STUB_SITE:-/tmp/stub-site}"
TRITON_DIR="${TRITON_DIR:-/tmp/triton}"

"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (@PYMAJOR@, @PYMINOR@))' \
  || { echo "error: $PY is not Python @PYTHON@ (the wheels and the stub are for @PYTHON@)" >&2; exit 1; }

install_wheels() {  # target wheel...
  local target="$1"; shift
  mkdir -p "$target"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$target" "$@"
  else  # no pip: a wheel is a zip of its site-packages files
    for w in "$@"; do "$PY" -m zipfile -e "$w" "$target"; done
  fi
}

echo "== wheels -> $SITE"
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
tar -xJf "$HERE/wheels.tar.xz" -C "$WHEELS"
install_wheels "$SITE" "$WHEELS"/wheels/*.whl
# WHEEL:MODULE: the wheel goes in where the host cannot import MODULE or has an older distribution
# (the name and version in the wheel's file name); the host's own copy is checked, not $SITE's
MISSING="$("$PY" - @IF_MISSING@ <<'EOF'
import importlib, importlib.metadata as md, re, sys

def older(have, want):
    try:
        from packaging.version import Version
        return Version(have) < Version(want)
    except Exception:  # no packaging, or a version it cannot read: compare the numbers
        nums = lambda v: tuple(int(x) for x in re.findall(r"\d+", v))
        return nums(have) < nums(want)

for spec in sys.argv[1:]:
    wheel, module = spec.split(":")
    dist, want = wheel.split("-")[:2]
    try:
        importlib.import_module(module)
        have = md.version(dist)
    except Exception as e:
        print(f"   {module}: missing on the host ({type(e).__name__}), installing {wheel}", file=sys.stderr)
        print(wheel)
        continue
    if older(have, want):
        print(f"   {module}: the host has {dist} {have}, older than {want}, installing {wheel}", file=sys.stderr)
        print(wheel)
    else:
        print(f"   {module}: the host's {dist} {have} is used", file=sys.stderr)
EOF
)"
if [ -n "$MISSING" ]; then
  mapfile -t missing <<<"$MISSING"
  tar -xJf "$HERE/wheels-if-missing.tar.xz" -C "$WHEELS"
  install_wheels "$SITE" "${missing[@]/#/$WHEELS/wheels-if-missing/}"
fi

STUB_EXPORT=""
if PYTHONPATH="$SITE" "$PY" -c 'import numpy, sys; sys.exit(int(numpy.__version__.split(".")[0]) >= 2)' 2>/dev/null; then
  echo "== host numpy is 1.x: the python-backend stub uses it"
else
  echo "== host numpy is 2.x (or missing): numpy @NUMPY@ -> $STUB_SITE for the python-backend stub only"
  mkdir -p "$STUB_SITE"
  tar -xJf "$HERE/stub-numpy.tar.xz" -C "$STUB_SITE"
  STUB_EXPORT="export CHATTTS_TRITON_STUB_PYTHONPATH=$STUB_SITE"
fi

echo "== tritonserver -> $TRITON_DIR"
mkdir -p "$TRITON_DIR"
tar -xJf "$HERE/tritonserver.tar.xz" -C "$TRITON_DIR"
SERVER="$TRITON_DIR/pytriton/tritonserver/bin/tritonserver"
LIBS="$TRITON_DIR/nvidia_pytriton.libs"
HELP="$(LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$SERVER" --help 2>&1 || true)"  # exits 1
if grep -q "Usage: tritonserver" <<<"$HELP"; then
  echo "   tritonserver runs"
else
  echo "   WARNING: $SERVER does not run (missing system library? try ldd): ${HELP:0:300}" >&2
fi

# The stub links libpython@PYTHON@.so.1.0: a static-only Python cannot run python models.
"$PY" - <<'EOF' || true
import ctypes.util, os, sysconfig
name = sysconfig.get_config_var("INSTSONAME") or "libpython@PYTHON@.so.1.0"
libdir = sysconfig.get_config_var("LIBDIR") or ""
if os.path.exists(os.path.join(libdir, name)) or ctypes.util.find_library("python@PYTHON@"):
    print("   " + name + " found")
else:
    print("   WARNING: " + name + " not found: install libpython@PYTHON@ (the python backend stub needs it)")
EOF

echo "== perf_analyzer -> $TRITON_DIR/perf-analyzer"
tar -xJf "$HERE/perf-analyzer.tar.xz" -C "$TRITON_DIR"

echo "== import check"
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF' || true
import importlib, subprocess, sys
for name in @HOST_IMPORTS@:
    try:
        importlib.import_module(name)
        print("   ok      " + name)
    except Exception as e:  # report every gap at once, with the root cause
        cause = e.__cause__ or e
        print("   MISSING " + name + ": " + type(cause).__name__ + ": " + str(cause)[:200])
for name in @ALONE_IMPORTS@:  # each in a fresh process: Locust's gevent patching fails once ssl is imported
    run = subprocess.run([sys.executable, "-c", "import " + name], capture_output=True, text=True)
    if run.returncode == 0:
        print("   ok      " + name)
    else:
        print("   MISSING " + name + ": " + (run.stderr.strip().splitlines() or ["exit %d" % run.returncode])[-1][:200])
EOF

cat <<EOF

Export these (then run e.g. python -m chattts_triton.serve from the repository):
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export TRITONSERVER=$SERVER
export LD_LIBRARY_PATH=$LIBS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export PERF_ANALYZER=$TRITON_DIR/perf-analyzer/perf_analyzer
$STUB_EXPORT
EOF
"""  # noqa: E501  a bash script: its lines are as bash reads them


def store_wheel(src: Path, dst: Path) -> Path:
    """`src` rewritten with its members stored instead of deflated: the same wheel (names, bytes, dates,
    modes, RECORD) that xz then compresses across all the wheels of a tar."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, data)
    return dst


def write_wheels_tar_xz(wheels: Sequence[Path], folder: str, out: Path) -> Path:
    """`wheels`, stored (store_wheel), under `folder`/ in one .tar.xz."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / folder).mkdir()
        for wheel in wheels:
            store_wheel(wheel, Path(tmp) / folder / wheel.name)
        return write_tar_xz(Path(tmp), out)


def write_site_tar_xz(wheel: Path, out: Path, drop_tests: bool = True) -> Path:
    """A wheel unpacked as it would be installed (a wheel is a zip of site-packages), as .tar.xz."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        for path in Path(tmp).rglob("*"):  # zipfile drops the executable bit
            if path.is_file() and (path.suffix == ".so" or ".so." in path.name):
                path.chmod(0o755)
        if drop_tests:
            for tests in sorted(Path(tmp).rglob("tests"), reverse=True):
                if tests.is_dir():
                    shutil.rmtree(tests)
        return write_tar_xz(Path(tmp), out)


def write_install_sh(out_dir: Path, python: str, if_missing_wheels: dict[str, Path],
                     imports: Sequence[str] = HOST_IMPORTS, alone: Sequence[str] = ()) -> Path:
    """install.sh for Python `python`; `if_missing_wheels`: import name → its wheel in wheels-if-missing/;
    `imports`: what its last check imports, in one process; `alone`: then each in a process of its own."""
    major, minor = python.split(".")
    specs = " ".join(f"{w.name}:{module}" for module, w in if_missing_wheels.items())
    text = (
        INSTALL_SH.replace("@PYTHON@", python)
        .replace("@PYMAJOR@", major)
        .replace("@PYMINOR@", minor)
        .replace("@IF_MISSING@", specs)
        .replace("@NUMPY@", STUB_NUMPY[1])
        .replace("@HOST_IMPORTS@", repr(tuple(imports)))
        .replace("@ALONE_IMPORTS@", repr(tuple(alone)))
    )
    path = out_dir / "install.sh"
    path.write_text(text)
    path.chmod(0o755)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_bundle(
    out_dir: Path, python: str = "3.12", groups: Sequence[str] = DEFAULT_GROUPS, log=print
) -> dict[str, int]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in ("wheels", "wheels-if-missing"):  # the folders of an earlier layout, and the tars of an earlier build
        shutil.rmtree(out_dir / old, ignore_errors=True)
        (out_dir / f"{old}.tar.xz").unlink(missing_ok=True)
    downloads = Path(tempfile.mkdtemp(prefix="bundle-wheels-"))
    try:
        log(f"wheels for Python {python} ...")
        wheels = download_wheels(PACKAGES, downloads / "wheels", python)
        write_wheels_tar_xz(wheels, "wheels", out_dir / "wheels.tar.xz")
        if_missing = {}
        for group in groups:
            log(f"group {group} ...")
            for name, version, module in IF_MISSING_GROUPS[group]:
                download_wheels([(name, version)], downloads / "wheels-if-missing", python)
                if_missing[module] = _wheel_for(downloads / "wheels-if-missing", name, version)
        if if_missing:
            write_wheels_tar_xz(list(if_missing.values()), "wheels-if-missing", out_dir / "wheels-if-missing.tar.xz")
        inside = sorted(p for p in downloads.rglob("*.whl"))
        inside = [(p.stat().st_size, _sha256(p), str(p.relative_to(downloads))) for p in inside]
    finally:
        shutil.rmtree(downloads, ignore_errors=True)
    log("numpy 1.x for the python-backend stub ...")
    with tempfile.TemporaryDirectory() as tmp:
        (wheel,) = download_wheels([STUB_NUMPY], Path(tmp), python)
        write_site_tar_xz(wheel, out_dir / "stub-numpy.tar.xz")
    log("tritonserver tree ...")
    with tempfile.TemporaryDirectory() as tmp:
        assemble_server_tree(Path(tmp), tuple(int(x) for x in python.split(".")))
        write_tar_xz(Path(tmp), out_dir / "tritonserver.tar.xz")
    log("perf_analyzer ...")
    from bench.perf import LIBS, prepare

    binary = prepare()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "perf-analyzer"
        tree.mkdir()
        for f in (binary, *(binary.parent / lib for lib in LIBS)):
            shutil.copy2(f, tree / f.name)
        write_tar_xz(Path(tmp), out_dir / "perf-analyzer.tar.xz")
    imports = HOST_IMPORTS + (GATEWAY_IMPORTS if "gateway" in groups else ())
    write_install_sh(out_dir, python, if_missing, imports, alone=LOCUST_IMPORTS if "locust" in groups else ())
    files = sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != "MANIFEST.txt")
    sizes = {str(p.relative_to(out_dir)): p.stat().st_size for p in files}
    with open(out_dir / "MANIFEST.txt", "w") as f:
        for p in files:
            f.write(f"{sizes[str(p.relative_to(out_dir))]:>12}  {_sha256(p)}  {p.relative_to(out_dir)}\n")
        f.write("# the wheels in wheels*.tar.xz, as downloaded (size, sha256); stored uncompressed there\n")
        for size, sha, name in inside:
            f.write(f"{size:>12}  {sha}  {name}\n")
    return sizes


def select_groups(asked: Sequence[str], left_out: set[str], log=lambda msg: print(msg, file=sys.stderr)) -> list[str]:
    """The groups asked for less those left out, and less any that needs one left out (GROUP_NEEDS), saying so."""
    groups = [g for g in dict.fromkeys(asked) if g not in left_out]
    for group in list(groups):
        lacking = [g for g in GROUP_NEEDS.get(group, ()) if g not in groups]
        if lacking:  # e.g. --without http: Locust cannot run without gevent
            log(f"note: leaving the {group} group out too: it needs {', '.join(lacking)}")
            groups.remove(group)
    return groups


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bundle", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--python", default="3.12", help="host Python version (default 3.12)")
    p.add_argument(
        "--with", dest="groups", action="append", default=list(DEFAULT_GROUPS), choices=sorted(IF_MISSING_GROUPS),
        help=f"optional wheel group, installed on the host only if missing (default: {', '.join(DEFAULT_GROUPS)})",
    )
    p.add_argument("--without", action="append", default=[], choices=DEFAULT_GROUPS, metavar="GROUP",
                   help=f"leave a default group out ({', '.join(DEFAULT_GROUPS)})")
    p.add_argument("--without-http", action="store_true", help="the same as --without http")
    args = p.parse_args(argv)
    groups = select_groups(args.groups, set(args.without) | ({"http"} if args.without_http else set()))
    sizes = build_bundle(args.out_dir, args.python, groups=groups)
    for name, size in sizes.items():
        print(f"{size / 1e6:9.2f} MB  {name}")
    total = sum(sizes.values()) / 1e6
    print(f"{total:9.2f} MB  total (budget {SIZE_BUDGET_MB} MB)")
    if total > SIZE_BUDGET_MB:
        print(f"warning: over the {SIZE_BUDGET_MB} MB budget", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
