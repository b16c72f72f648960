"""Helpers shared by the reliability, fuzz and soak tests: private servers, requests, processes."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from chattts_triton.config import ENSEMBLE_INPUTS
from chattts_triton.launcher.tritonserver import TritonServer, python_stubs

NP = {"TYPE_STRING": object, "TYPE_INT64": np.int64, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_BOOL": bool}
WIRE = {"TYPE_STRING": "BYTES", "TYPE_INT64": "INT64", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32", "TYPE_BOOL": "BOOL"}
SHM_PREFIX = "triton_python_backend_shm_region_"


def contract_inputs(module, **values):
    """InferInputs with the contract's dtypes, each shaped [1, 1] (SPEAKER_AUDIO: [1, N])."""
    out = []
    for name, v in values.items():
        dtype = ENSEMBLE_INPUTS[name][0]
        if name == "SPEAKER_AUDIO":
            arr = np.asarray(v, np.float32).reshape(1, -1)
        elif dtype == "TYPE_STRING":
            arr = np.array([[v.encode("utf-8", "surrogatepass") if isinstance(v, str) else v]], dtype=object)
        else:
            arr = np.array([[v]], dtype=NP[dtype])
        t = module.InferInput(name, list(arr.shape), WIRE[dtype])
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def raw_input(module, name: str, arr: np.ndarray, wire: str):
    t = module.InferInput(name, list(arr.shape), wire)
    t.set_data_from_numpy(arr)
    return t


def grpc_synth(url: str, timeout_s: float | None = None, **values) -> np.ndarray:
    c = grpcclient.InferenceServerClient(url)
    try:
        return c.infer("chattts", contract_inputs(grpcclient, **values), client_timeout=timeout_s).as_numpy("AUDIO")[0]
    finally:
        c.close()


def http_status(url: str, path: str, method: str = "GET", body: bytes | None = None,
                headers: dict[str, str] | None = None, timeout_s: float = 10.0):
    """(status, body) of a plain HTTP call; status None when the connection fails."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(f"http://{url}{path}", data=body, method=method, headers=headers or {})
    try:
        with opener.open(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return None, b""


def private_server(tiny_assets: Path, tmp: Path, extra_args=(), exit_timeout_s: int = 30, **deployment) -> TritonServer:
    """A not-yet-started server on its own copy of the tiny repository (for destructive tests)."""
    from tests.conftest import export_repo

    repo = export_repo(tiny_assets, tmp / "repo", **deployment)
    return TritonServer(repo, log_file=tmp / "tritonserver.log", exit_timeout_s=exit_timeout_s,
                        startup_timeout_s=600, extra_args=list(extra_args))


def stub_processes(server: TritonServer) -> dict[str, dict]:
    """Python-backend stubs of `server`, by instance name: pid and shared-memory region."""
    out = {}
    for pid, args in python_stubs(server.pid).items():
        region = next((a for a in args if a.startswith(SHM_PREFIX)), None)
        model_dir = Path(args[1]).parent.parent.name if len(args) > 1 else "?"
        # the instance name (`<model>_<group>_<index>`) is one argument; its position differs between versions
        instance = next((a for a in args[2:] if a.startswith(f"{model_dir}_")), f"{model_dir}?{pid}")
        out[instance] = {"pid": pid, "region": region, "model": model_dir}
    return out


def shm_regions() -> list[str]:
    try:
        return sorted(f for f in os.listdir("/dev/shm") if f.startswith(SHM_PREFIX))
    except OSError:
        return []


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
