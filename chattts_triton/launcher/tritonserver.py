"""Find, configure and run a real `tritonserver` process.

Where the server comes from:
- env `TRITONSERVER=/path/to/bin/tritonserver` wins (e.g. the offline bundle from `tools.bundle`);
- otherwise the copy shipped in the `nvidia-pytriton` wheel (Triton 2.51).

Both share one layout, the wheel's (`ROOT = bin/..`):

    ROOT/bin/tritonserver
    ROOT/backends/python/{libtriton_python.so, triton_python_backend_utils.py}
    ROOT/python_backend_stubs/3.X/triton_python_backend_stub   (one per Python version)
    ROOT/caches/local/libtritoncache_local.so
    ROOT/../../nvidia_pytriton.libs/*.so   (or ROOT/lib/*.so)

The python backend needs a stub built for the Python that runs the model code, placed next to
`libtriton_python.so`; `prepare_backend_dir` assembles such a folder under `build/` (the wheel's
own folder stays untouched). An NGC image (`TRITONSERVER=/opt/tritonserver/bin/tritonserver`) has no
`python_backend_stubs/`: its one stub, built for the image's Python, already sits in
`ROOT/backends/python`, and `ROOT/backends` is used as it is.

Generated folders go under `build/` of the repository, or under `$CHATTTS_TRITON_CACHE` when set
(an installed package's folder is usually read-only; the image sets it).

Which packages the stub sees: the 2.51 stub ignores PYTHONPATH. Its embedded interpreter finds
`python3` on PATH and honours a `pyvenv.cfg` there, so `prepare_python_env` writes a tiny venv
(under `build/triton-pyenv/`) whose `.pth` adds, in order: `$CHATTTS_TRITON_STUB_PYTHONPATH` /
`extra_pythonpath`, the repository root, and every package folder of the launching interpreter
(its venv, `--target` folders, PYTHONPATH). `server_env` puts that venv's `bin/` first on PATH and
the server's libraries plus this Python's libpython on LD_LIBRARY_PATH.

The stub needs numpy 1.x: its pybind11 predates numpy 2, with which every output tensor silently
arrives empty and BYTES inputs abort the stub. `TritonServer` checks the numpy the stub will
import and refuses numpy 2 (`CHATTTS_TRITON_STUB_PYTHONPATH` can point at a numpy 1.26 folder
that only the stub sees; `tools.bundle` ships one).

`TritonServer` starts the server in its own process group bound to 127.0.0.1, waits until the
server and every model in the repository are ready, and on any failure raises `TritonServerError`
carrying the tail of the server log. `stop()` drains with SIGTERM (Triton waits for in-flight
requests, including ones answered later through a response sender), then kills the whole group.
Servers still running at interpreter exit are stopped; the server also gets SIGTERM if the thread
that started it dies (PR_SET_PDEATHSIG), so start it from a long-lived thread.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ENV = "CHATTTS_TRITON_CACHE"  # where generated folders go instead of REPO_ROOT/build
DEFAULT_BACKEND_CACHE = REPO_ROOT / "build" / "triton-backends"
DEFAULT_PYENV_CACHE = REPO_ROOT / "build" / "triton-pyenv"
STUB_NAME = "triton_python_backend_stub"
PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
LOCALHOST = "127.0.0.1"
STUB_PATH_ENV = "CHATTTS_TRITON_STUB_PYTHONPATH"  # package folders only the stub sees, searched first
LOG_TAIL_LINES = 60


class TritonServerError(RuntimeError):
    """The server could not be found, prepared, started, or did not become ready."""


class TritonSetupError(TritonServerError, ValueError):
    """Bad arguments or an unusable installation (missing binary, no stub for this Python)."""


# --- locating the installation -----------------------------------------------------------------
def find_tritonserver() -> Path:
    """Path of the `tritonserver` binary: `$TRITONSERVER`, else the nvidia-pytriton wheel's."""
    override = os.environ.get("TRITONSERVER")
    if override:
        path = Path(override).expanduser().resolve()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise TritonSetupError(f"TRITONSERVER={override} is not an executable file")
        return path
    try:
        import pytriton
    except ImportError as e:
        raise TritonSetupError(
            "no tritonserver: set TRITONSERVER=/path/to/bin/tritonserver or pip install nvidia-pytriton"
        ) from e
    path = Path(pytriton.__file__).resolve().parent / "tritonserver" / "bin" / "tritonserver"
    if not path.is_file():
        raise TritonSetupError(f"the nvidia-pytriton wheel has no server binary at {path}")
    return path


def server_root(tritonserver: Path) -> Path:
    return Path(tritonserver).resolve().parent.parent


def find_library_dir(tritonserver: Path) -> Path | None:
    """Folder with the server's bundled shared libraries (wheel: nvidia_pytriton.libs)."""
    root = server_root(tritonserver)
    for candidate in (root.parent.parent / "nvidia_pytriton.libs", root / "lib"):
        if candidate.is_dir():
            return candidate
    return None


def _python_tag(version: Sequence[int] | None = None) -> str:
    major, minor = (version or sys.version_info)[:2]
    return f"{major}.{minor}"


def _cache_dir(default: Path) -> Path:
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() / default.name if override else default


def stub_python_tags(stub: Path) -> set[str]:
    """Python versions ("3.12") whose libpython the stub binary names; empty if none (static)."""
    import re

    return {m.decode() for m in re.findall(rb"libpython(\d+\.\d+)", Path(stub).read_bytes())}


def find_stub(tritonserver: Path, python_version: Sequence[int] | None = None) -> Path:
    """The python-backend stub built for `python_version` (default: the running interpreter).

    Wheel/bundle layout: ROOT/python_backend_stubs/3.X/; NGC layout (no such folder): the one stub in
    ROOT/backends/python, accepted if it links this Python's libpython.
    """
    root = server_root(tritonserver)
    tag = _python_tag(python_version)
    stubs = root / "python_backend_stubs"
    stub = stubs / tag / STUB_NAME
    if stub.is_file():
        return stub
    in_place = root / "backends" / "python" / STUB_NAME
    if not stubs.is_dir() and in_place.is_file():
        built_for = stub_python_tags(in_place)
        if built_for and tag not in built_for:
            raise TritonSetupError(
                f"the python backend stub {in_place} is built for Python {', '.join(sorted(built_for))}, "
                f"not {tag}; run the launcher with that Python"
            )
        return in_place
    available = sorted(p.name for p in stubs.iterdir() if (p / STUB_NAME).is_file()) if stubs.is_dir() else []
    raise TritonSetupError(
        f"no python backend stub for Python {tag} under {stubs} "
        f"(available: {', '.join(available) or 'none'}); run with one of those Python versions"
    )


def _same_file(src: Path, dst: Path) -> bool:
    if not dst.is_file():
        return False
    a, b = src.stat(), dst.stat()
    return a.st_size == b.st_size and int(a.st_mtime) == int(b.st_mtime)


def prepare_backend_dir(
    tritonserver: Path | None = None,
    dest: Path | None = None,
    python_version: Sequence[int] | None = None,
) -> Path:
    """Assemble a `--backend-directory` whose `python/` holds the backend and the matching stub.

    NGC layout with no `dest`: the server's own `backends/` is returned, nothing is copied.
    Idempotent: files already up to date are left alone. Returns the backend directory.
    """
    tritonserver = Path(tritonserver) if tritonserver else find_tritonserver()
    root = server_root(tritonserver)
    source = root / "backends" / "python"
    missing = [f for f in PYTHON_BACKEND_FILES if not (source / f).is_file()]
    if missing:
        raise TritonSetupError(f"python backend incomplete under {source}: lacks {', '.join(missing)}")
    stub = find_stub(tritonserver, python_version)
    if dest is None and stub.parent == source:
        return source.parent  # NGC layout: the server's own folder is complete
    if dest is None:
        # One folder per installation and Python version, so a bundle and the wheel never mix.
        key = hashlib.sha1(str(root).encode()).hexdigest()[:10]
        dest = _cache_dir(DEFAULT_BACKEND_CACHE) / f"py{_python_tag(python_version)}-{key}"
    dest = Path(dest)
    target = dest / "python"
    target.mkdir(parents=True, exist_ok=True)
    for src, name in [(source / f, f) for f in PYTHON_BACKEND_FILES] + [(stub, STUB_NAME)]:
        dst = target / name
        if not _same_file(src, dst):
            tmp = target / f".{name}.tmp{os.getpid()}"
            shutil.copy2(src, tmp)
            os.replace(tmp, dst)  # atomic: parallel test sessions never see half a stub
    return dest


def _launcher_import_paths() -> list[str]:
    """Folders this interpreter imports packages from (venv, --target dirs, PYTHONPATH), no stdlib."""
    base = Path(sys.base_prefix).resolve()
    script_dir = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    paths: list[str] = []
    for entry in sys.path:
        if not entry or entry.endswith(".zip") or not Path(entry).is_dir():
            continue
        path = Path(entry).resolve()
        if path == script_dir and entry == sys.path[0]:
            continue  # the launching script's folder, not a package location
        in_base = path == base or base in path.parents
        if in_base and not ({"site-packages", "dist-packages"} & set(path.parts)):
            continue  # the stub's own interpreter provides the stdlib
        if str(path) not in paths:
            paths.append(str(path))
    return paths


def find_libpython() -> Path:
    """Directory (or loader-known name) of this interpreter's shared libpython, which the stub links."""
    soname = sysconfig.get_config_var("INSTSONAME") or f"libpython{_python_tag()}.so.1.0"
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and (Path(libdir) / soname).exists():
        return Path(libdir) / soname
    import ctypes.util

    found = ctypes.util.find_library(f"python{_python_tag()}")
    if found:
        return Path(found)
    raise TritonSetupError(
        f"the python backend stub needs the shared library {soname}, which this Python "
        f"({sys.executable}) does not provide; install it (e.g. apt install libpython{_python_tag()}) "
        "or use a Python built with --enable-shared"
    )


def prepare_python_env(
    dest: Path | None = None,
    extra_paths: Sequence[os.PathLike] = (),
) -> Path:
    """A tiny virtual environment that makes the stub see the same packages as this interpreter.

    The 2.51 stub ignores PYTHONPATH; its embedded Python finds `python3` on PATH and honours a
    `pyvenv.cfg` next to it (as pytriton relies on). So we write such a venv: its interpreter is
    this one's base, and a `.pth` file adds `extra_paths`, the repository root and every package
    folder of this interpreter (processing their own .pth files, e.g. editable installs).
    Returns the venv root; put its `bin/` first on the server's PATH.
    """
    tag = _python_tag()
    extra_paths = list(extra_paths) + [p for p in os.environ.get(STUB_PATH_ENV, "").split(os.pathsep) if p]
    base_exe = Path(getattr(sys, "_base_executable", None) or sys.executable)
    if not base_exe.is_file():
        raise TritonSetupError(f"cannot locate the base Python interpreter ({base_exe})")
    sitedirs = [str(Path(p).resolve()) for p in extra_paths] + [str(REPO_ROOT)] + _launcher_import_paths()
    sitedirs = list(dict.fromkeys(sitedirs))
    # One line: site.py exec()s lines starting with "import" (no comprehension: its scope lacks `site`).
    pth = f"import site; list(map(site.addsitedir, {sitedirs!r}))\n"
    cfg = f"home = {base_exe.parent}\ninclude-system-site-packages = false\nversion = {sys.version.split()[0]}\n"
    if dest is None:
        key = hashlib.sha1((str(base_exe) + cfg + pth).encode()).hexdigest()[:10]
        dest = _cache_dir(DEFAULT_PYENV_CACHE) / f"py{tag}-{key}"
    dest = Path(dest)
    site_dir = dest / "lib" / f"python{tag}" / "site-packages"
    site_dir.mkdir(parents=True, exist_ok=True)
    (dest / "bin").mkdir(exist_ok=True)
    _write_if_changed(dest / "pyvenv.cfg", cfg)
    _write_if_changed(site_dir / "_chattts_triton_paths.pth", pth)
    for name in ("python", "python3", f"python{tag}"):
        link = dest / "bin" / name
        if not (link.is_symlink() and os.readlink(link) == str(base_exe)):
            tmp = dest / "bin" / f".{name}.tmp{os.getpid()}"
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            os.symlink(base_exe, tmp)
            os.replace(tmp, link)
    return dest


def check_stub_numpy(env: Mapping[str, str], python_env: Path) -> str:
    """numpy version the stub will import; raise unless it is 1.x.

    The 2.51 stub's pybind11 predates numpy 2: with numpy 2 every pb_utils.Tensor output reaches
    the client with 0 bytes and a BYTES input aborts the stub, without any load error.
    """
    probe = [str(python_env / "bin" / "python3"), "-c", "import numpy; print(numpy.__version__, numpy.__file__)"]
    result = subprocess.run(probe, env=dict(env), capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise TritonSetupError(f"the python backend stub cannot import numpy: {result.stderr.strip()[-500:]}")
    version, location = result.stdout.split(maxsplit=1)
    if int(version.split(".")[0]) >= 2:
        raise TritonSetupError(
            f"the python backend stub would import numpy {version} ({location.strip()}); Triton 2.51's "
            "stub only works with numpy 1.x (numpy 2 silently empties outputs). Put a numpy<2 "
            f"(e.g. 1.26.4) first for the stub: {STUB_PATH_ENV}=/dir/with/numpy1 or extra_pythonpath"
        )
    return version


def _write_if_changed(path: Path, text: str) -> None:
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _join(parts: Iterable[str | None]) -> str:
    seen: list[str] = []
    for part in parts:
        for p in (part or "").split(os.pathsep):
            if p and p not in seen:
                seen.append(p)
    return os.pathsep.join(seen)


def server_env(
    tritonserver: Path | None = None,
    python_env: Path | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for the server and its python stubs (which inherit it).

    LD_LIBRARY_PATH: the server's bundled libraries and this Python's libpython;
    PATH: `python_env/bin` first, which selects the stub's interpreter and packages.
    """
    tritonserver = Path(tritonserver) if tritonserver else find_tritonserver()
    python_env = Path(python_env) if python_env else prepare_python_env()
    env = dict(os.environ if base is None else base)
    libs = find_library_dir(tritonserver)
    libpython = find_libpython()
    libpython_dir = str(libpython.parent) if libpython.is_absolute() else None  # else the loader knows it
    env["LD_LIBRARY_PATH"] = _join([str(libs) if libs else None, libpython_dir, env.get("LD_LIBRARY_PATH")])
    env["PATH"] = _join([str(python_env / "bin"), env.get("PATH", os.defpath)])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# --- ports -------------------------------------------------------------------------------------
def free_port(host: str = LOCALHOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port(host)
        if p not in ports:
            ports.append(p)
    return ports


def model_names(model_repository: Path) -> list[str]:
    """Models the server will load in `--model-control-mode none`: folders with a config.pbtxt."""
    return sorted(p.name for p in Path(model_repository).iterdir() if (p / "config.pbtxt").is_file())


def set_parent_death_signal() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001  best effort: not every libc has prctl
        pass


def processes_in_group(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is `pgid` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def python_stubs(server_pid: int) -> dict[int, list[str]]:
    """The python-backend stubs of the tritonserver `server_pid`, pid → argv: its live children whose
    program (argv[0]) is the stub. What a stub starts in turn (torch inductor's compile workers, which
    exit by themselves a minute after start-up; MPS clients; anything a model runs) is its child, not
    the server's, so it is never taken for a stub (Linux /proc)."""
    stubs: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z" or int(fields[1]) != server_pid:  # a zombie stub is a dead one
                continue
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if argv and Path(argv[0]).name == STUB_NAME:
            stubs[int(entry.name)] = argv
    return stubs


_LIVE_SERVERS: set[TritonServer] = set()  # stopped at interpreter exit if the caller forgot


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.stop()


class TritonServer:
    """A `tritonserver` child process serving one model repository on 127.0.0.1.

    Ports default to free ones. Use as a context manager, or call `start()` / `stop()`.
    `extra_args` are appended to the command line (e.g. `--http-restricted-api=...`);
    `ready_headers` are sent with the readiness probes (needed if those APIs are restricted).
    `log_file="-"`: the server logs to this process's stdout (containers); `log_path` is then None.
    """

    def __init__(
        self,
        model_repository: os.PathLike,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        host: str = LOCALHOST,
        log_file: os.PathLike | None = None,
        exit_timeout_s: int = 30,
        startup_timeout_s: float = 180.0,
        extra_args: Sequence[str] = (),
        tritonserver: os.PathLike | None = None,
        backend_dir: os.PathLike | None = None,
        extra_pythonpath: Sequence[os.PathLike] = (),
        env: Mapping[str, str] | None = None,
        ready_headers: Mapping[str, str] | None = None,
        log_verbose: int = 0,
        check_numpy: bool = True,
    ):
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise TritonSetupError(f"model repository {model_repository} is not a directory")
        for name, port in (("http_port", http_port), ("grpc_port", grpc_port), ("metrics_port", metrics_port)):
            if port is not None and not (0 < int(port) < 65536):
                raise TritonSetupError(f"{name}={port} is not a TCP port")
        if exit_timeout_s < 0 or startup_timeout_s <= 0:
            raise TritonSetupError("exit_timeout_s must be >= 0 and startup_timeout_s > 0")
        self.tritonserver = Path(tritonserver).resolve() if tritonserver else find_tritonserver()
        self.backend_dir = Path(backend_dir) if backend_dir else prepare_backend_dir(self.tritonserver)
        self.host = host
        self._fixed_ports = (http_port, grpc_port, metrics_port)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        if log_file is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            log_file = name
        self.log_path: Path | None = None if str(log_file) == "-" else Path(log_file)
        self.exit_timeout_s = int(exit_timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.extra_args = list(extra_args)
        self.python_env = prepare_python_env(extra_paths=extra_pythonpath)
        self.env = server_env(self.tritonserver, self.python_env, env)
        self.stub_numpy_version = check_stub_numpy(self.env, self.python_env) if check_numpy else None
        self.ready_headers = dict(ready_headers or {})
        self.log_verbose = int(log_verbose)
        self.process: subprocess.Popen | None = None
        self._log_handle = None

    # -- urls -----------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:  # tritonclient.http style: host:port, no scheme
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def command(self) -> list[str]:
        cmd = [
            str(self.tritonserver),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.backend_dir}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.host}",
            "--model-control-mode=none",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
        ]
        caches = server_root(self.tritonserver) / "caches"
        if caches.is_dir():
            cmd.append(f"--cache-directory={caches}")
        return cmd + self.extra_args

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None:
            return "(see the server log above, on stdout)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, wait: bool = True) -> TritonServer:
        if self.process is not None and self.process.poll() is None:
            raise TritonServerError(f"server already running (pid {self.process.pid})")
        auto_ports = all(p is None for p in self._fixed_ports)
        attempts = 3 if auto_ports else 1
        for attempt in range(attempts):
            self._launch()
            if not wait:
                return self
            try:
                self.wait_ready()
                return self
            except TritonServerError as e:
                # Another process may have grabbed a port between probing and binding: retry.
                if attempt + 1 < attempts and "already in use" in str(e):
                    continue
                raise
        return self  # unreachable

    def _launch(self) -> None:
        fixed = self._fixed_ports
        if any(p is None for p in fixed):
            picked = iter(free_ports(3, self.host))
            self.http_port, self.grpc_port, self.metrics_port = (p if p is not None else next(picked) for p in fixed)
        self._close_log()
        self._log_handle = open(self.log_path, "wb") if self.log_path is not None else None
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle,  # None: inherits stdout
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=str(self.model_repository),
            start_new_session=True,  # own process group: stop() can reap stubs too
            preexec_fn=set_parent_death_signal,
        )
        _LIVE_SERVERS.add(self)

    def _failure(self, reason: str) -> TritonServerError:
        return TritonServerError(
            f"tritonserver {reason} (repository {self.model_repository}, log {self.log_path or 'stdout'}); "
            f"last log lines:\n{self.log_tail()}"
        )

    def _probe(self, models: Sequence[str]) -> bool:
        """Server and every model ready (KServe v2 health endpoints; stdlib only, so the launcher
        runs even where tritonclient's HTTP extras are missing)."""
        import urllib.error
        import urllib.request

        paths = ["/v2/health/ready"] + [f"/v2/models/{urllib.parse.quote(m)}/ready" for m in models]
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via http_proxy
        try:
            for path in paths:
                request = urllib.request.Request(f"http://{self.http_url}{path}", headers=self.ready_headers)
                with opener.open(request, timeout=2.0) as response:
                    if response.status != 200:
                        return False
            return True
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the server and every model are ready; raise with the log tail otherwise."""
        if self.process is None:
            raise TritonServerError("server not started")
        models = model_names(self.model_repository)
        deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        delay = 0.1
        while True:
            code = self.process.poll()
            if code is not None:
                self.stop()  # reaps stubs left behind
                raise self._failure(f"exited with status {code} before becoming ready")
            if self._probe(models):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise self._failure(f"was not ready (server and models {models}) within the startup timeout")
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def send_signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self) -> int | None:
        """SIGTERM (Triton drains in-flight requests), wait exit-timeout + margin, then SIGKILL the group."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.exit_timeout_s + 15)
            except subprocess.TimeoutExpired:
                pass
        self._reap_group()
        _LIVE_SERVERS.discard(self)
        self._close_log()
        return self.process.returncode

    def _reap_group(self) -> None:
        """Kill whatever is left in the server's process group (stubs whose parent died)."""
        assert self.process is not None
        pgid = self.process.pid  # start_new_session: the group id is the server's pid
        for sig, grace_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                break  # group already empty
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                self.process.poll()  # reap our direct child so it is not counted as alive
                if not processes_in_group(pgid):
                    break
                time.sleep(0.05)
            else:
                continue
            break
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def _close_log(self) -> None:
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.returncode is None and self.process else f"exit={self.returncode}"
        return f"TritonServer({self.model_repository}, http={self.http_url}, grpc={self.grpc_url}, {state})"
