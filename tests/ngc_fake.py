"""A stand-in for an NGC tritonserver image's /opt/tritonserver (no python_backend_stubs/; the stub sits in
backends/python), whose `bin/tritonserver` fakes just enough of Triton for the launcher: health and
metrics endpoints, one "stub" child in its process group (which starts a short-lived helper process of its own),
a drain on SIGTERM. It records its argv (and the helper's pid in RECORD.helper)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

FAKE_SERVER = r'''
import json, os, signal, subprocess, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
# the "stub": this Python under the stub's program name (as the launcher recognises stubs), which starts
# a helper process of its own that ends after a second, as torch's compile workers end after start-up
HELPER = "import subprocess, sys, time; h = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1)']); " \
         "open(sys.argv[2], 'w').write(str(h.pid)); h.wait(); time.sleep(300)"
stub = subprocess.Popen([STUB_PROGRAM, "-c", HELPER, "triton_python_backend_shm_region_1", RECORD + ".helper"])
for _ in range(200):  # ready only once the helper runs, as the compile workers run when a real server is ready
    if os.path.exists(RECORD + ".helper"):
        break
    __import__("time").sleep(0.05)
json.dump({"argv": sys.argv[1:], "stub_pid": stub.pid, "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
           "env_has_admin_key": "CHATTTS_ADMIN_KEY" in os.environ}, open(RECORD, "w"))

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'chattts_inflight_requests{model="chattts_gpt"} 0\n' if self.path == "/metrics" else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

def on_term(signum, frame):
    print(f"Signal ({signum}) received, fake tritonserver exiting", flush=True)
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)
for port in (flags["metrics-port"], flags["http-port"]):  # http last: ready once it answers
    server = ThreadingHTTPServer((flags["http-address"], int(port)), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
print("fake tritonserver serving", flush=True)
while True:
    signal.pause()
'''


def python_tag(version: Sequence[int] | None = None) -> str:
    major, minor = (version or sys.version_info)[:2]
    return f"{major}.{minor}"


def make_ngc_tree(dest: Path, record: Path, stub_python: Sequence[int] | None = None) -> Path:
    """dest/opt/tritonserver laid out like the NGC image; returns its bin/tritonserver."""
    root = dest / "opt" / "tritonserver"
    python = root / "backends" / "python"
    python.mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "lib").mkdir()
    (root / "caches" / "local").mkdir(parents=True)
    (root / "backends" / "onnxruntime").mkdir()
    (python / "libtriton_python.so").write_bytes(b"\x7fELF fake")
    (python / "triton_python_backend_utils.py").write_text("# fake\n")
    stub = python / "triton_python_backend_stub"
    stub.write_bytes(b"\x7fELF\0libpython" + python_tag(stub_python).encode() + b".so.1.0\0libc.so.6\0")
    stub.chmod(0o755)
    stub_program = dest / "stub-program" / "triton_python_backend_stub"  # a Python under the stub's name
    stub_program.parent.mkdir()
    stub_program.symlink_to(os.path.realpath(sys.executable))
    server = root / "bin" / "tritonserver"
    server.write_text(f"#!{sys.executable}\nRECORD = {str(record)!r}\nSTUB_PROGRAM = "
                      f"{str(stub_program)!r}\n{FAKE_SERVER}")
    server.chmod(0o755)
    return server


def make_fake_repository(dest: Path) -> Path:
    """The smallest folder the entry point and the launcher accept as a model repository."""
    (dest / "chattts").mkdir(parents=True)
    (dest / "chattts" / "config.pbtxt").write_text('name: "chattts"\n')
    (dest / "manifest.json").write_text("{}\n")
    return dest


def launcher_env(tmp: Path, server: Path, **extra: str) -> dict:
    """Environment as in the image: $TRITONSERVER, a writable $CHATTTS_TRITON_CACHE and $HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATTTS_", "TRITON"))}
    env.update(TRITONSERVER=str(server), CHATTTS_TRITON_CACHE=str(tmp / "cache"), HOME=str(tmp / "home"),
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env
