"""Run tritonserver in the foreground on a model repository.

    python -m chattts_triton.serve --repo build/repo [--http-port 8000] [--grpc-port 8001]
        [--metrics-port 8002] [--host 127.0.0.1] [--log-file F|-] [--log-verbose N] [--restrict-apis]
        [-- EXTRA TRITONSERVER ARGS]

Binds to 127.0.0.1 unless told otherwise, waits until the server and every model are ready,
prints the URLs, and on SIGINT/SIGTERM drains: new requests get UNAVAILABLE, the ones in flight
finish (up to --exit-timeout seconds), then Triton is signalled and drains what is left (up to
--exit-timeout more); the exit status is the server's. So a supervisor's grace period must cover
2 x --exit-timeout plus about 25 s.
Port 0 picks a free port. `--log-file -` sends the server log to stdout (containers).

On a non-loopback --host (or with --restrict-apis) the shared-memory, model-repository, logging and
trace APIs need the HTTP header `chattts-admin-key: KEY` (gRPC metadata
`triton-grpc-protocol-chattts-admin-key: KEY`). KEY comes from env CHATTTS_ADMIN_KEY, else is
generated once into a 0600 file (--admin-key-file; default env CHATTTS_ADMIN_KEY_FILE or
~/.chattts-triton/admin.key). The key is never printed or logged (it is on tritonserver's command
line, which local users can read: keep the host to trusted users).

If a python-backend stub dies, Triton 2.51 neither restarts it nor turns unready: serve.py then
kills the server and exits with status 70 so that its supervisor restarts it. Stubs are the server's
children running the stub program; the processes they start (torch's compile workers, which end by
themselves after start-up) are not watched.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..config import DRAIN_FILE_ENV, ENSEMBLE, INFLIGHT_METRIC, STACKS_SIGNAL
from .mps import MpsError, mps_daemon
from .tritonserver import LOCALHOST, TritonServer, TritonServerError, python_stubs

PENDING_METRIC = "nv_inference_pending_request_count"  # Triton's: queued, not yet in execute()
SHM_PREFIX = "triton_python_backend_shm_region_"
STUB_DIED_EXIT = 70  # EX_SOFTWARE: a model process died; restart the server
ADMIN_HEADER = "chattts-admin-key"  # HTTP header; lower case like gRPC metadata keys
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER  # how Triton 2.51 expects it over gRPC
RESTRICTED_APIS = "shared-memory,model-repository,logging,trace"
ADMIN_KEY_ENV = "CHATTTS_ADMIN_KEY"
ADMIN_KEY_FILE_ENV = "CHATTTS_ADMIN_KEY_FILE"


def restricted_args(host: str, force: bool, key: str) -> list[str]:
    """tritonserver flags that put the admin APIs behind ADMIN_HEADER; none on loopback unless forced."""
    if host in (LOCALHOST, "localhost") and not force:
        return []
    rule = f"{RESTRICTED_APIS}:{ADMIN_HEADER}={key}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


def admin_key(key_file: Path) -> str:
    """The admin key: env CHATTTS_ADMIN_KEY, else the one in `key_file`, else a new one written there (0600)."""
    key = os.environ.get(ADMIN_KEY_ENV, "").strip()
    if key:
        return key
    if key_file.is_file():
        key = key_file.read_text(encoding="utf-8").strip()
        if key:
            return key
    key = secrets.token_urlsafe(32)
    key_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key + "\n")
    os.chmod(key_file, 0o600)
    print(f"admin key for the restricted APIs written to {key_file} (mode 0600)", flush=True)
    return key


def inflight_requests(metrics_url: str) -> int | None:
    """Sum of the models' in-flight gauges (config.INFLIGHT_METRIC); None if unreadable or absent."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(metrics_url, timeout=2.0) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError:
        return None
    return parse_inflight(text)


def parse_inflight(text: str) -> int | None:
    ours = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(INFLIGHT_METRIC + "{")]
    # requests still in a composing model's Triton queue are not in our gauges yet
    queued = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(PENDING_METRIC + "{") and f'model="{ENSEMBLE}"' not in line]
    return int(sum(ours) + sum(queued)) if ours else None


def quiesce(server: TritonServer, drain_file: Path, timeout_s: float, quiet_polls: int = 3,
            poll_s: float = 0.2) -> bool:
    """Stop admitting (the ensemble's entry rejects with UNAVAILABLE) and wait until nothing is in flight.

    Needed because Triton 2.51, once signalled, rejects an in-flight ensemble request at its next step
    ("Server is stopping, scheduler for model has stopped accepting new inference requests").
    Idle must hold for `quiet_polls` polls in a row: a request passing between two steps is briefly
    counted by neither model.
    """
    drain_file.touch()
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while time.monotonic() < deadline and server.returncode is None:
        n = inflight_requests(server.metrics_url)
        if n is None:
            return False  # no gauge: fall back to Triton's own drain
        quiet = quiet + 1 if n == 0 else 0
        if quiet >= quiet_polls:
            return True
        time.sleep(poll_s)
    return False


def stub_shm_regions(stubs: dict[int, list[str]]) -> list[str]:
    """The python-backend shared-memory regions the stubs (pid → argv) use, named on their command lines."""
    return [a for argv in stubs.values() for a in argv if a.startswith(SHM_PREFIX)]


def remove_shm_regions(regions) -> None:
    """Unlink regions a killed server left in /dev/shm (a graceful exit removes them itself)."""
    for region in regions:
        try:
            os.unlink(os.path.join("/dev/shm", region))
        except OSError:
            pass


def _port(text: str) -> int | None:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port")
    return value or None  # 0: let the launcher pick a free one


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m chattts_triton.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", required=True, type=Path, help="model repository")
    p.add_argument("--http-port", type=_port, default=8000)
    p.add_argument("--grpc-port", type=_port, default=8001)
    p.add_argument("--metrics-port", type=_port, default=8002)
    p.add_argument("--host", default=LOCALHOST, help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it)")
    p.add_argument("--log-file", type=Path, default=None,
                   help="server log; - for stdout (default: a temporary file)")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose")
    p.add_argument("--restrict-apis", action="store_true",
                   help=f"put {RESTRICTED_APIS} behind the {ADMIN_HEADER} header even on loopback "
                        "(always on otherwise)")
    p.add_argument("--admin-key-file", type=Path,
                   default=Path(os.environ.get(ADMIN_KEY_FILE_ENV) or Path.home() / ".chattts-triton" / "admin.key"))
    p.add_argument("--exit-timeout", type=int, default=30, help="seconds Triton may drain on shutdown")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument("--mps", action="store_true",
                   help="run a CUDA MPS daemon for the server's lifetime, so the model processes share the GPU "
                        "instead of taking turns (needs nvidia-cuda-mps-control; leave off where the host runs MPS)")
    p.add_argument(
        "--stub-pythonpath", action="append", default=[], type=Path,
        help="package folder only the python-backend stub sees, searched first (repeatable)",
    )
    args = p.parse_args(argv)
    if not args.repo.is_dir():
        p.error(f"--repo {args.repo} is not a directory")
    args.extra = extra
    return args


def _exit_status(returncode: int | None) -> int:
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N -> 128+N


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.mps:
        return _serve(args, {})
    try:
        with mps_daemon() as mps_env:
            print(f"MPS daemon: pipe {mps_env['CUDA_MPS_PIPE_DIRECTORY']}", flush=True)
            return _serve(args, mps_env)
    except MpsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def watch(server: TritonServer, stubs: set[int], stopping: list[int], drain: Callable[[], None], drain_file: Path,
           exit_timeout: float) -> list[int]:
    """Until tritonserver exits or is stopped: a signal drains it (waiting up to its exit timeout), a python backend
    stub that dies kills it. The stubs that died, or none."""
    while server.returncode is None:
        if stopping:
            quiesce(server, drain_file, exit_timeout)
            drain()  # the signal may have come before the process existed
            now = time.monotonic()
            deadline, stacks_due = now + exit_timeout + 15, now + exit_timeout / 2
            while server.returncode is None and time.monotonic() < deadline:
                if stacks_due is not None and time.monotonic() >= stacks_due:
                    stacks_due = None
                    ask_stubs_for_stacks(server, exit_timeout / 2)
                time.sleep(0.1)
            return []
        dead = sorted(stubs - set(python_stubs(server.pid)))
        if dead:  # Triton 2.51 never restarts it: its requests hang, later ones fail, yet /ready says 200
            print(f"error: python backend stub(s) {dead} died; stopping so that the supervisor restarts "
                  f"the server; last log lines:\n{server.log_tail(10)}", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                os.killpg(server.pid, signal.SIGKILL)  # what the dead stub held can never finish
            return dead
        time.sleep(0.2)
    return []


def ask_stubs_for_stacks(server: TritonServer, waited_s: float) -> list[int]:
    """STACKS_SIGNAL to every python stub of `server`: each writes its threads' stacks to the server's log (the
    models' `dump_stacks_on_signal`). The stubs asked."""
    pids = sorted(python_stubs(server.pid))
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            os.kill(pid, STACKS_SIGNAL)
    print(f"tritonserver still draining {waited_s:.0f} s after the signal: asked its python stubs {pids} to write "
          f"their threads' stacks to the server log", file=sys.stderr, flush=True)
    return pids


def _serve(args: argparse.Namespace, extra_env: dict[str, str]) -> int:
    if args.host not in (LOCALHOST, "localhost"):
        print(f"warning: binding to {args.host}: the server is reachable from other hosts", file=sys.stderr)
    restricted: list[str] = []
    if args.restrict_apis or args.host not in (LOCALHOST, "localhost"):
        restricted = restricted_args(args.host, True, admin_key(args.admin_key_file))
        print(f"restricted APIs ({RESTRICTED_APIS}) need the {ADMIN_HEADER} header", flush=True)
    drain_dir = tempfile.mkdtemp(prefix="chattts-drain-")
    drain_file = Path(drain_dir) / "drain"
    server = TritonServer(
        args.repo,
        env={**{k: v for k, v in os.environ.items() if k != ADMIN_KEY_ENV}, DRAIN_FILE_ENV: str(drain_file),
             **extra_env},
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        log_file=args.log_file,
        log_verbose=args.log_verbose,
        exit_timeout_s=args.exit_timeout,
        startup_timeout_s=args.startup_timeout,
        extra_args=restricted + args.extra,
        extra_pythonpath=args.stub_pythonpath,
    )
    stopping: list[int] = []
    signalled: list[bool] = []
    serving: list[bool] = []

    def drain() -> None:
        if server.pid is not None and not signalled:
            signalled.append(True)
            server.send_signal(signal.SIGTERM)  # Triton drains in-flight requests, then exits

    def on_signal(signum, _frame):
        stopping.append(signum)
        if len(stopping) > 1 and server.pid is not None:
            print("second signal: killing tritonserver", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                os.killpg(server.pid, signal.SIGKILL)
        if not serving:  # still loading: nothing in flight, stop at once
            drain()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"log: {server.log_path or 'stdout'}", flush=True)
    try:
        server.start()
    except TritonServerError as e:
        server.stop()
        if stopping:  # interrupted while loading: not an error
            return _exit_status(server.returncode)
        print(f"error: {e}", file=sys.stderr)
        return 1
    found = python_stubs(server.pid)  # watched from before "ready" is announced
    stubs, regions = set(found), stub_shm_regions(found)
    print(f"tritonserver pid {server.pid} ready", flush=True)
    print(f"http: {server.http_url}\ngrpc: {server.grpc_url}\nmetrics: {server.metrics_url}", flush=True)
    serving.append(True)
    dead: list[int] = []
    try:
        dead = watch(server, stubs, stopping, drain, drain_file, args.exit_timeout)
    finally:
        code = server.stop()  # kills whatever is left (stubs, a server past its drain time)
        remove_shm_regions(regions)
        shutil.rmtree(drain_dir, ignore_errors=True)
    if dead:
        return STUB_DIED_EXIT
    if not stopping:
        print(f"error: tritonserver exited unexpectedly ({code}); last log lines:\n{server.log_tail()}",
              file=sys.stderr)
    return _exit_status(code)


class Launched:
    """`python -m chattts_triton.serve` as a child process on free ports, as a container runs it: for
    benchmarks, soaks and tests that must measure the shipped path. With `supervise`, an exit it was not
    asked for is counted in `restarts` and the launcher started again on the same ports, as Docker's
    `--restart` or the kubelet would (every such exit is in `exits`). Use as a context manager."""

    def __init__(self, repo: Path, log_file: Path, args: Sequence[str] = (), env: dict[str, str] | None = None,
                 ready_timeout_s: float = 900.0, exit_timeout: int = 60, supervise: bool = True):
        from .tritonserver import free_ports

        self.repo, self.log_file, self.args, self.env = Path(repo), Path(log_file), list(args), env
        self.ready_timeout_s, self.exit_timeout, self.supervise = ready_timeout_s, exit_timeout, supervise
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3, LOCALHOST)
        self.proc: subprocess.Popen | None = None
        self.server_pid: int | None = None
        self.output: list[str] = []  # the launcher's own lines (the server log goes to log_file)
        self.restarts = 0
        self.exits: list[tuple[float, int | None]] = []  # (monotonic time, exit status) of unasked exits
        self.ready_s: list[float] = []  # seconds from each start to ready
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

    http_url = property(lambda self: f"{LOCALHOST}:{self.http_port}")
    grpc_url = property(lambda self: f"{LOCALHOST}:{self.grpc_port}")
    metrics_url = property(lambda self: f"http://{LOCALHOST}:{self.metrics_port}/metrics")

    def _launch(self) -> None:
        cmd = [sys.executable, "-m", "chattts_triton.serve", "--repo", str(self.repo),
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--metrics-port", str(self.metrics_port), "--log-file", str(self.log_file),
               "--exit-timeout", str(self.exit_timeout), "--startup-timeout", str(self.ready_timeout_s), *self.args]
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env,
                                     start_new_session=True)
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("tritonserver pid"):
                self.server_pid = int(line.split()[2])
                self.ready_s.append(time.monotonic() - t0)
                break
        if self.server_pid is None or self.proc.poll() is not None:
            self.proc.wait()
            raise TritonServerError(f"the launcher exited ({self.proc.returncode}) before "
                                    f"ready:\n{''.join(self.output[-30:])}")
        threading.Thread(target=self._drain_output, args=(self.proc,), daemon=True).start()

    def _drain_output(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.output.append(line)

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            proc = self.proc
            code = proc.wait() if proc is not None else None
            if self._stopping.is_set():
                return
            self.exits.append((time.monotonic(), code))
            self.output.append(f"[supervisor] the launcher exited with status {code}; starting it again\n")
            self.restarts += 1
            self.server_pid = None
            try:
                self._launch()
            except TritonServerError as e:
                self.output.append(f"[supervisor] restart failed: {e}\n")
                return

    def start(self) -> Launched:
        self._launch()
        if self.supervise:
            self._watch = threading.Thread(target=self._supervise, name="chattts-supervisor", daemon=True)
            self._watch.start()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (the launcher drains), wait; the launcher's exit status (a second signal kills it)."""
        self._stopping.set()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s if timeout_s is not None else 2 * self.exit_timeout + 30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)  # the second signal: the launcher kills the server
            return self.proc.wait(30)

    def __enter__(self) -> Launched:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
