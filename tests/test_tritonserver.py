"""The tritonserver launcher, and the serving pattern the engine is built on, on a real Triton 2.51.

Spike (tests/fixtures/spike_repo): a NON-decoupled python model answers through the response
sender from background threads and returns None from execute(). Requests then run in flight:
they overlap in time, finish out of order, each client gets exactly its own answer or its own
error, over HTTP and gRPC, alone and as a step of an ensemble (with an optional input omitted).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from chattts_triton.launcher import tritonserver as ts
from chattts_triton.launcher.tritonserver import TritonServer, TritonServerError, TritonSetupError

ROOT = Path(__file__).resolve().parents[1]
SPIKE_REPO = ROOT / "tests" / "fixtures" / "spike_repo"


# --- client helpers ----------------------------------------------------------------------------
def _client_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as module
    else:
        import tritonclient.grpc as module
    return module


def _infer(server: TritonServer, protocol: str, model: str, ident: int, delay_ms: int, scale=None, barrier=None):
    """One request on its own connection. Returns (outputs dict, None) or (None, error text)."""
    mod = _client_module(protocol)
    client = mod.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    batched = model != "async_echo"
    shape = [1, 1] if batched else [1]
    inputs = [mod.InferInput("ID", shape, "INT64"), mod.InferInput("DELAY_MS", shape, "INT32")]
    inputs[0].set_data_from_numpy(np.array([ident], np.int64).reshape(shape))
    inputs[1].set_data_from_numpy(np.array([delay_ms], np.int32).reshape(shape))
    if scale is not None:
        inputs.append(mod.InferInput("SCALE", shape, "INT64"))
        inputs[-1].set_data_from_numpy(np.array([scale], np.int64).reshape(shape))
    try:
        if barrier is not None:
            barrier.wait()
        result = client.infer(model, inputs)
        names = ["ID_OUT", "T_START", "T_END"] + (["BATCH"] if batched else [])
        return {n: result.as_numpy(n).reshape(-1)[0].item() for n in names}, None
    except Exception as e:  # noqa: BLE001  the test inspects the message
        return None, str(e)
    finally:
        client.close()  # an idle keep-alive connection would hold up server shutdown


def _concurrent(server, protocol, model, specs):
    """Send all requests at the same instant; return their results in spec order and the wall time."""
    barrier = threading.Barrier(len(specs))
    start = time.monotonic()
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(_infer, server, protocol, model, *spec, barrier=barrier) for spec in specs]
        results = [f.result() for f in futures]
    return results, time.monotonic() - start


@pytest.fixture(scope="module")
def spike_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("spike") / "tritonserver.log"
    with TritonServer(SPIKE_REPO, log_file=log, exit_timeout_s=10) as server:
        yield server


# --- the spike ---------------------------------------------------------------------------------
DELAYS = {10: 900, 11: 100, 12: 600, 13: 300}


def _check_in_flight(results, specs, expected_ids):
    """`specs` are the first requests of `results` (those expected to succeed); later ones are not checked here."""
    ok = {spec[0]: out for spec, (out, err) in zip(specs, results[:len(specs)], strict=True) if err is None}
    assert set(ok) == set(expected_ids), results
    for ident, out in ok.items():
        assert out["ID_OUT"] == expected_ids[ident]  # each client got its own answer
    # Out of order: completion follows each request's own delay, not arrival order.
    by_end = sorted(ok, key=lambda i: ok[i]["T_END"])
    assert by_end == sorted(ok, key=lambda i: DELAYS[i])
    # In flight: the longest request was running while every other one started and finished (on the
    # server's clock; the clients' wall time also holds their connections' set-up and close: 2.3 s
    # once on a loaded CI box for a 0.9-s longest request)
    longest = ok[max(ok, key=lambda i: DELAYS[i])]
    for out in ok.values():
        assert longest["T_START"] <= out["T_START"] + 0.15 and out["T_END"] <= longest["T_END"]
    # Dynamic batching handed several requests to one execute() call, answered separately.
    assert max(out["BATCH"] for out in ok.values()) >= 2


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_response_sender_from_thread_runs_requests_in_flight(spike_server, protocol):
    specs = [(10, 900), (11, 100), (12, 600), (13, 300), (-5, 200)]
    results, _ = _concurrent(spike_server, protocol, "slow_echo", specs)
    _check_in_flight(results, specs, {i: i for i in DELAYS})
    out, err = results[-1]
    assert out is None and "slow_echo rejects negative ID -5" in err  # only that client failed


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_response_sender_inside_ensemble_with_optional_input(spike_server, protocol):
    # SCALE given for 10 and 12, omitted (optional) for 11 and 13.
    specs = [(10, 900, 3), (11, 100), (12, 600, 2), (13, 300), (-5, 200), (14, -1)]
    results, _ = _concurrent(spike_server, protocol, "pipeline", specs)
    _check_in_flight(results, specs[:4], {10: 30, 11: 11, 12: 24, 13: 13})
    assert "slow_echo rejects negative ID -5" in results[4][1]  # error from the in-flight step
    assert "prep rejects negative DELAY_MS" in results[5][1]  # error from the plain step
    assert results[4][0] is None and results[5][0] is None


@pytest.mark.e2e
def test_async_execute_is_accepted_but_serialised(spike_server):
    """Finding for the design: `async def execute` loads and answers in a non-decoupled model,
    but the stub awaits each call to completion, so separate requests do not overlap."""
    specs = [(1, 500), (2, 500), (3, 500)]
    results, wall = _concurrent(spike_server, "http", "async_echo", specs)
    outs = [out for out, err in results]
    assert all(err is None for _, err in results), results
    assert sorted(o["ID_OUT"] for o in outs) == [1, 2, 3]
    spans = sorted((o["T_START"], o["T_END"]) for o in outs)
    for (_, end), (next_start, _) in pairwise(spans):
        assert next_start >= end - 0.01  # one after the other
    assert wall >= 1.4


# --- the launcher ------------------------------------------------------------------------------
@pytest.mark.e2e
def test_ready_server_has_free_ports_and_binds_localhost(spike_server):
    ports = {spike_server.http_port, spike_server.grpc_port, spike_server.metrics_port}
    assert len(ports) == 3 and all(isinstance(p, int) and p > 0 for p in ports)
    assert spike_server.http_url == f"127.0.0.1:{spike_server.http_port}"
    assert spike_server.grpc_url == f"127.0.0.1:{spike_server.grpc_port}"
    with urllib.request.urlopen(f"http://{spike_server.http_url}/v2/health/ready", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(spike_server.metrics_url, timeout=5) as r:
        assert b"nv_inference_request_success" in r.read()
    log = spike_server.log_path.read_text(errors="replace")
    assert f"Started HTTPService at 127.0.0.1:{spike_server.http_port}" in log
    assert f"Started GRPCInferenceService at 127.0.0.1:{spike_server.grpc_port}" in log
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(spike_server.http_url)
    try:
        assert all(client.is_model_ready(m) for m in ("slow_echo", "prep", "pipeline", "async_echo"))
    finally:
        client.close()


@pytest.mark.e2e
def test_stop_drains_in_flight_request_and_leaves_no_process(tmp_path):
    server = TritonServer(SPIKE_REPO, log_file=tmp_path / "log", exit_timeout_s=10).start()
    pgid = server.pid
    assert len(ts.processes_in_group(pgid)) >= 4  # server + one stub per python model
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_infer, server, "grpc", "slow_echo", 7, 2000)
        time.sleep(0.5)  # the request is now inside the model's background thread
        code = server.stop()
        out, err = pending.result()
    assert err is None and out["ID_OUT"] == 7  # answered during the drain, not cut off
    assert code == 0
    assert ts.processes_in_group(pgid) == []
    assert "in-flight inferences" in server.log_path.read_text(errors="replace")


def _write_model(repo: Path, name: str, model_py: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        textwrap.dedent(
            f"""
            name: "{name}"
            backend: "python"
            max_batch_size: 0
            input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
            output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
            instance_group [ {{ count: 1 kind: KIND_CPU }} ]
            """
        )
    )
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model_py))


@pytest.mark.e2e
def test_model_failing_to_load_raises_with_log_tail(tmp_path):
    repo = tmp_path / "repo"
    _write_model(
        repo,
        "broken",
        """
        class TritonPythonModel:
            def initialize(self, args):
                raise RuntimeError("weights folder xyzzy-42 is missing")
        """,
    )
    server = TritonServer(repo, log_file=tmp_path / "log", exit_timeout_s=5, startup_timeout_s=120)
    with pytest.raises(TritonServerError) as info:
        server.start()
    message = str(info.value)
    assert "weights folder xyzzy-42 is missing" in message and "broken" in message
    assert server.returncode is not None
    assert ts.processes_in_group(server.pid) == []


@pytest.mark.e2e
def test_model_code_imports_repository_packages(tmp_path):
    """The stub ignores PYTHONPATH; the launcher's generated venv must still reach the repo."""
    repo = tmp_path / "repo"
    _write_model(
        repo,
        "uses_repo",
        """
        import numpy as np
        import triton_python_backend_utils as pb_utils
        from chattts_triton import config

        class TritonPythonModel:
            def execute(self, requests):
                return [
                    pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([config.SAMPLE_RATE], np.int32))])
                    for _ in requests
                ]
        """,
    )
    import tritonclient.http as httpclient

    from chattts_triton.config import SAMPLE_RATE

    with TritonServer(repo, log_file=tmp_path / "log", exit_timeout_s=5) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        try:
            x = httpclient.InferInput("X", [1], "INT32")
            x.set_data_from_numpy(np.array([0], np.int32))
            assert client.infer("uses_repo", [x]).as_numpy("Y").tolist() == [SAMPLE_RATE]
        finally:
            client.close()


@pytest.mark.e2e
def test_serve_cli_foreground_ready_and_clean_exit_on_sigint(tmp_path):
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "chattts_triton.serve", "--repo", str(SPIKE_REPO), "--http-port", "0",
           "--grpc-port", "0", "--metrics-port", "0", "--log-file", str(log), "--exit-timeout", "5"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = {}
        deadline = time.monotonic() + 120
        while "metrics" not in lines and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            key, _, value = line.strip().partition(": ")
            lines[key] = value
            if line.startswith("tritonserver pid"):
                lines["pid"] = int(line.split()[2])
        assert "metrics" in lines, (lines, proc.stderr.read() if proc.poll() is not None else "")
        assert lines["http"].startswith("127.0.0.1:") and lines["grpc"].startswith("127.0.0.1:")
        with urllib.request.urlopen(f"http://{lines['http']}/v2/health/ready", timeout=5) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert ts.processes_in_group(lines["pid"]) == []
        assert "Signal (15) received" in log.read_text(errors="replace")  # forwarded as a drain
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.e2e
def test_server_from_bundle_layout_via_env_override(tmp_path, monkeypatch):
    """The tree tools.bundle ships, found through $TRITONSERVER, serves the spike repository."""
    from tools.bundle import assemble_server_tree

    root = assemble_server_tree(tmp_path / "bundle", python_version=sys.version_info[:2])  # stripped
    monkeypatch.setenv("TRITONSERVER", str(root / "bin" / "tritonserver"))
    assert ts.find_tritonserver() == (root / "bin" / "tritonserver").resolve()
    # Without LD_LIBRARY_PATH from the wheel: the bundle's own library folder must be found.
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    backends = ts.prepare_backend_dir(dest=tmp_path / "backends")  # from the bundle, via $TRITONSERVER
    assert str(tmp_path / "bundle") in os.path.realpath(ts.find_stub(ts.find_tritonserver()))
    with TritonServer(SPIKE_REPO, log_file=tmp_path / "log", exit_timeout_s=5, backend_dir=backends) as server:
        assert str(tmp_path) in server.env["LD_LIBRARY_PATH"].split(os.pathsep)[0]
        out, err = _infer(server, "http", "pipeline", 4, 10, 5)
        assert err is None and out["ID_OUT"] == 20


# --- set-up errors (no server) -----------------------------------------------------------------
def test_backend_dir_is_idempotent_and_complete(tmp_path):
    first = ts.prepare_backend_dir(dest=tmp_path / "b")
    files = {p.name: p.stat().st_mtime_ns for p in (first / "python").iterdir()}
    assert set(files) == {"libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"}
    again = ts.prepare_backend_dir(dest=tmp_path / "b")
    assert again == first
    assert {p.name: p.stat().st_mtime_ns for p in (again / "python").iterdir()} == files
    assert os.access(first / "python" / "triton_python_backend_stub", os.X_OK)


def test_missing_stub_version_is_a_clear_error():
    with pytest.raises(TritonSetupError, match=r"no python backend stub for Python 3\.99 .*available: .*3\.12"):
        ts.prepare_backend_dir(python_version=(3, 99))


def test_tritonserver_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONSERVER", str(tmp_path / "nope"))
    with pytest.raises(TritonSetupError, match="TRITONSERVER=.*nope is not an executable"):
        ts.find_tritonserver()
    monkeypatch.delenv("TRITONSERVER")
    assert ts.find_tritonserver().name == "tritonserver"


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(TritonSetupError, match="not a directory"):
        TritonServer(tmp_path / "missing")
    with pytest.raises(TritonSetupError, match="http_port=70000 is not a TCP port"):
        TritonServer(SPIKE_REPO, http_port=70000)


def test_numpy_2_for_the_stub_is_refused(tmp_path):
    """Triton 2.51's stub returns empty outputs with numpy 2: refuse before starting."""
    fake = tmp_path / "np2"
    (fake / "numpy").mkdir(parents=True)
    (fake / "numpy" / "__init__.py").write_text("__version__ = '2.1.0'\n")
    with pytest.raises(TritonSetupError, match=r"numpy 2\.1\.0 .*only works with numpy 1\.x"):
        TritonServer(SPIKE_REPO, extra_pythonpath=[fake], log_file=tmp_path / "log")


def test_stub_venv_mirrors_launcher_packages(tmp_path):
    env_root = ts.prepare_python_env(dest=tmp_path / "venv", extra_paths=[tmp_path / "first"])
    probe = "import sys, numpy, chattts_triton; print(numpy.__file__); print(chattts_triton.__file__); print(sys.path)"
    out = subprocess.run([str(env_root / "bin" / "python3"), "-c", probe], capture_output=True, text=True,
                         env={"PATH": os.defpath}, check=True).stdout.splitlines()
    import numpy

    assert out[0] == numpy.__file__  # same numpy as this interpreter, whatever the global install holds
    assert Path(out[1]).resolve() == (ROOT / "chattts_triton" / "__init__.py").resolve()
    path = eval(out[2])
    assert path.index(str((tmp_path / "first").resolve())) < path.index(str(ROOT))


# --- NGC image layout (stand-in tree, no server) -------------------------------------------------
def test_ngc_layout_serves_from_the_servers_own_backends(tmp_path, monkeypatch):
    """/opt/tritonserver of an NGC image: no python_backend_stubs/, the stub already in backends/python."""
    from tests.ngc_fake import make_fake_repository, make_ngc_tree

    server = make_ngc_tree(tmp_path / "ngc", tmp_path / "argv.json")
    root = server.resolve().parent.parent
    monkeypatch.setenv("TRITONSERVER", str(server))
    monkeypatch.setenv(ts.CACHE_ENV, str(tmp_path / "cache"))
    assert ts.find_stub(ts.find_tritonserver()) == root / "backends" / "python" / ts.STUB_NAME
    assert ts.prepare_backend_dir() == root / "backends"  # used as it is: nothing copied
    assert not (tmp_path / "cache" / "triton-backends").exists()
    copied = ts.prepare_backend_dir(dest=tmp_path / "b")  # an explicit folder still gets a copy
    assert (copied / "python" / ts.STUB_NAME).read_bytes() == (root / "backends" / "python" / ts.STUB_NAME).read_bytes()
    server_ = TritonServer(make_fake_repository(tmp_path / "repo"), log_file="-", http_port=8000, grpc_port=8001,
                           metrics_port=8002, log_verbose=1)
    cmd = server_.command()
    assert cmd[0] == str(root / "bin" / "tritonserver")
    assert f"--backend-directory={root / 'backends'}" in cmd and f"--cache-directory={root / 'caches'}" in cmd
    assert "--log-verbose=1" in cmd
    assert server_.env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(root / "lib")
    assert (tmp_path / "cache" / "triton-pyenv") in server_.python_env.parents  # not under site-packages
    assert server_.log_path is None and "stdout" in server_.log_tail()


def test_ngc_stub_for_another_python_is_refused(tmp_path):
    from tests.ngc_fake import make_ngc_tree

    server = make_ngc_tree(tmp_path / "ngc", tmp_path / "argv.json", stub_python=(3, 99))
    assert ts.stub_python_tags(server.parent.parent / "backends" / "python" / ts.STUB_NAME) == {"3.99"}
    with pytest.raises(TritonSetupError, match=r"built for Python 3\.99, not 3\.\d+"):
        ts.find_stub(server)
    assert ts.find_stub(server, python_version=(3, 99)).name == ts.STUB_NAME


def test_cache_env_moves_generated_folders(tmp_path, monkeypatch):
    monkeypatch.setenv(ts.CACHE_ENV, str(tmp_path / "cache"))
    backends = ts.prepare_backend_dir()  # the wheel's layout: a copy with the stub
    assert backends.parent == tmp_path / "cache" / "triton-backends"
    assert (backends / "python" / ts.STUB_NAME).is_file()
