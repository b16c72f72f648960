"""Production deployment files: deploy/docker (image) and deploy/helm/chattts-triton (chart), checked offline.

No Docker daemon, cluster or GPU here. The Dockerfile is parsed (dockerfile-parse); its entry point and the
`make configure` step run for real against an exported tiny repository with a stand-in `python3`, and the image's
CMD runs through the entry point and the real launcher (chattts_triton.serve) on a stand-in of NGC's
/opt/tritonserver (tests/ngc_fake.py): SIGTERM drains and exits 0, a dead python stub exits 70. The
chart is rendered by Helm's own engine (helm-python-sdk: the Helm v4 Go SDK) and every manifest is validated
against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail); CRDs (ServiceMonitor,
PrometheusRule) get structural checks. Each check is also shown to reject a broken input.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import helm_python as helm  # helm-python-sdk: Helm's Go engine, no helm binary
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from tritonclient.grpc import model_config_pb2 as mc

from chattts_triton.config import GPT, MANIFEST, PREPROCESS, VOCODER
from chattts_triton.triton import repo_config as rc
from tests.ngc_fake import launcher_env, make_fake_repository, make_ngc_tree
from tests.reliability_util import wait_for

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
CHART = ROOT / "deploy" / "helm" / "chattts-triton"
VENV_BIN = Path(sys.executable).parent

# Triton releases that fixed published CVEs (NVIDIA security bulletins). The base image must be at least the
# newest of them. Add to this table when a bulletin appears; never lower the base image.
FIXED_IN = {
    "CVE-2025-23310": (25, 7),  # bulletin 5687: stack overflow via HTTP chunked transfer encoding
    "CVE-2025-23311": (25, 7),  # bulletin 5687: stack overflow via crafted HTTP requests
    "CVE-2025-23319": (25, 7),  # bulletin 5687: python backend out-of-bounds write (shared-memory chain)
    "CVE-2025-23320": (25, 7),  # bulletin 5687: python backend shared memory limit exceeded (info leak)
    "CVE-2025-23334": (25, 7),  # bulletin 5687: python backend out-of-bounds read
    "CVE-2025-23316": (25, 8),  # python backend RCE through the model name in the model control APIs
    "CVE-2026-47625": (26, 4),  # bulletin 5875: missing authorization
    "CVE-2026-16497": (26, 7),  # bulletin 5875: excessive iteration (DoS)
}
NGC_TRITON = re.compile(r"^nvcr\.io/nvidia/tritonserver:(\d{2})\.(\d{2})-py3$")
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
SPEECH_PORT = 8080  # the speech gateway (python3 -m gateway)
WYOMING_PORT = 10200  # the Wyoming server for Home Assistant (python3 -m gateway.wyoming)
LAUNCHER = ["python3", "-m", "chattts_triton.serve"]
NGC_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"


# --- Dockerfile ------------------------------------------------------------------------------------------------
def _parse_dockerfile(text: str):
    return DockerfileParser(fileobj=io.BytesIO(text.encode()), env_replace=True)


def _exec_form(value: str) -> list[str] | None:
    value = value.strip()
    if value.startswith("["):
        return json.loads(value)
    return None


def _split(argv: list[str]):
    """Launcher `--flag=value`s (before `--`) and the tritonserver arguments after it."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return _flags(argv[:cut]), argv[cut + 1 :]


def _image_cmd(text: str | None = None) -> list[str]:
    p = _parse_dockerfile(text or DOCKERFILE.read_text())
    return _exec_form([i["value"] for i in p.structure if i["instruction"] == "CMD"][-1])


def dockerfile_problems(text: str) -> list[str]:  # noqa: C901  a checklist: one branch per rule of a production Dockerfile
    """Everything wrong with a Dockerfile for production use (empty: fine)."""
    p = _parse_dockerfile(text)
    problems: list[str] = []
    final = p.baseimage or ""
    m = NGC_TRITON.match(final)
    floor = max(FIXED_IN.values())
    if not m:
        problems.append(f"final base image {final!r} is not an NGC tritonserver <yy.mm>-py3 release")
    elif (int(m.group(1)), int(m.group(2))) < floor:
        problems.append(f"base release {m.group(1)}.{m.group(2)} predates {floor[0]}.{floor[1]:02d}, "
                        "the newest CVE fix")
    final_stage = []
    for ins in p.structure:  # instructions of the last stage only
        if ins["instruction"] == "FROM":
            final_stage = []
        final_stage.append(ins)
    users = [i["value"].strip() for i in final_stage if i["instruction"] == "USER"]
    if not users:
        problems.append("no USER: the server would run as root")
    else:
        user = users[-1].split(":")[0]
        if user in ("root", "0"):
            problems.append(f"USER {users[-1]} is root")
        elif not user.isdigit():
            problems.append(f"USER {users[-1]} is not numeric: Kubernetes runAsNonRoot cannot verify a name")
    checks = [i["value"] for i in final_stage if i["instruction"] == "HEALTHCHECK"]
    if not checks or "/v2/health/ready" not in checks[-1] or ":8000/" not in checks[-1]:
        problems.append("HEALTHCHECK does not probe http://127.0.0.1:8000/v2/health/ready")
    exposed = {int(x.split("/")[0]) for i in final_stage if i["instruction"] == "EXPOSE" for x in i["value"].split()}
    wanted = set(PORTS.values()) | {SPEECH_PORT, WYOMING_PORT}
    if not wanted <= exposed:
        problems.append(f"EXPOSE {sorted(exposed)} lacks {sorted(wanted - exposed)}")
    cmds = [i["value"] for i in final_stage if i["instruction"] == "CMD"]
    cmd = _exec_form(cmds[-1]) if cmds else None
    if not cmd or cmd[:3] != LAUNCHER:
        problems.append("CMD is not the exec-form launcher `python3 -m chattts_triton.serve` (no drain, no watchdog)")
    else:
        flags, _ = _split(cmd[3:])
        if flags.get("--host") != "0.0.0.0":
            problems.append("CMD lacks --host=0.0.0.0 (the launcher binds 127.0.0.1 otherwise)")
        if not flags.get("--repo"):
            problems.append("CMD lacks --repo=")
        if not flags.get("--exit-timeout", "").isdigit():
            problems.append("CMD lacks --exit-timeout=N")
        if flags.get("--log-file") != "-":
            problems.append("CMD lacks --log-file=- (the server log would grow in /tmp, not go to stdout)")
    envs = p.envs
    if envs.get("TRITONSERVER") != NGC_TRITONSERVER:
        problems.append(f"ENV TRITONSERVER is not {NGC_TRITONSERVER}: the launcher would not find NGC's server")
    if not envs.get("CHATTTS_TRITON_CACHE", "").startswith("/tmp/"):
        problems.append("ENV CHATTTS_TRITON_CACHE is not under /tmp: site-packages is read-only to uid 1000")
    runs = " ".join(i["value"] for i in final_stage if i["instruction"] == "RUN")
    if '".[gateway]"' not in runs or "import gateway.app" not in runs:
        problems.append("the package is not installed with its gateway extra (and imported): no python3 -m gateway")
    if "gateway.wyoming" not in runs:
        problems.append("gateway.wyoming is not imported at build: python3 -m gateway.wyoming may lack the wyoming "
                        "package")
    copied = [i["value"].split()[-1] for i in final_stage if i["instruction"] == "COPY"]
    if "/opt/chattts/src/gateway" not in copied:
        problems.append("gateway/ is not copied into the image")
    if not all(pkg in runs for pkg in ("gcc", "python3-dev")):
        problems.append("no gcc/python3-dev: the compiled GPT step (the GPU default) cannot build its kernels' "
                        "launcher")
    entry = [i["value"] for i in final_stage if i["instruction"] == "ENTRYPOINT"]
    if entry and not (_exec_form(entry[-1]) or [""])[0].startswith("/"):
        problems.append("ENTRYPOINT is not an exec-form absolute path (signals would not reach the launcher)")
    return problems


def test_dockerfile_is_production_ready():
    assert dockerfile_problems(DOCKERFILE.read_text()) == []


def test_dockerfile_base_is_the_documented_release():
    text = DOCKERFILE.read_text()
    p = _parse_dockerfile(text)
    assert p.parent_images[-1] == p.baseimage
    for cve in FIXED_IN:
        assert cve in text, f"{cve} (in FIXED_IN) is not cited in the Dockerfile comment"


@pytest.mark.parametrize(
    "change, complaint",
    [
        (("ARG TRITON_RELEASE=26.09", "ARG TRITON_RELEASE=25.06"), "predates"),  # before the 2025 fixes
        (("ARG TRITON_RELEASE=26.09", "ARG TRITON_RELEASE=26.06"), "predates"),  # before CVE-2026-16497
        (("nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3", "ubuntu:24.04"), "not an NGC"),
        (("USER 1000:1000", "USER root"), "is root"),
        (("USER 1000:1000", "USER triton-server"), "not numeric"),
        (("USER 1000:1000\n", ""), "no USER"),
        (("/v2/health/ready", "/v2/health/live"), "HEALTHCHECK"),
        (("EXPOSE 8000 8001 8002", "EXPOSE 8000 8001"), "lacks [8002]"),
        (("EXPOSE 8000 8001 8002 8080 10200", "EXPOSE 8000 8001 8002 10200"), "lacks [8080]"),
        (("EXPOSE 8000 8001 8002 8080 10200", "EXPOSE 8000 8001 8002 8080"), "lacks [10200]"),
        (("import gateway.app, gateway.wyoming,", "import gateway.app,"), "gateway.wyoming is not imported"),
        (('".[gateway]"', "."), "gateway extra"),
        (("COPY gateway /opt/chattts/src/gateway\n", ""), "gateway/ is not copied"),
        (('"python3", "-m", "chattts_triton.serve", ', '"tritonserver", '), "not the exec-form launcher"),
        (('"--host=0.0.0.0", ', ""), "--host=0.0.0.0"),
        (('"--exit-timeout=60", ', ""), "--exit-timeout=N"),
        (('"--log-file=-", ', ""), "--log-file=-"),
        ((f"TRITONSERVER={NGC_TRITONSERVER}", "TRITONSERVER=/usr/bin/tritonserver"), "ENV TRITONSERVER"),
        (("CHATTTS_TRITON_CACHE=/tmp/", "CHATTTS_TRITON_CACHE=/opt/"), "CHATTTS_TRITON_CACHE"),
        ((" gcc libc6-dev python3-dev", " libc6-dev"), "no gcc/python3-dev"),
    ],
)
def test_dockerfile_check_rejects(change, complaint):
    text = DOCKERFILE.read_text()
    old, new = change
    assert old in text
    problems = dockerfile_problems(text.replace(old, new, 1))
    assert any(complaint in p for p in problems), problems


def test_docker_context_holds_every_copied_path():
    """COPY sources exist and pass Dockerfile.dockerignore (else the build fails on a clean checkout)."""
    p = _parse_dockerfile(DOCKERFILE.read_text())
    allowed = [
        line[1:].rstrip("/")
        for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    sources = []
    for ins in p.structure:
        if ins["instruction"] != "COPY" or "--from=" in ins["value"]:
            continue
        parts = [x for x in ins["value"].split() if not x.startswith("--")]
        sources += parts[:-1]
    assert sources
    for src in sources:
        src = src.rstrip("/")
        assert (ROOT / src).exists(), src
        assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is excluded from the context"


def test_pip_constraints_from_requirements():
    """The RUN line's sed turns requirements.txt into constraints pip accepts (no extras) with the same pins."""
    run = next(i["value"] for i in _parse_dockerfile(DOCKERFILE.read_text()).structure
               if i["instruction"] == "RUN" and "constraints" in i["value"])
    expr = re.search(r"sed -E '([^']+)' requirements\.txt", run).group(1)
    out = subprocess.run(["sed", "-E", expr, str(ROOT / "requirements.txt")], capture_output=True, text=True,
                         check=True).stdout
    pins = dict(line.split("==") for line in out.splitlines() if "==" in line)
    assert "[" not in out
    req = {re.sub(r"\[.*\]", "", k): v for k, v in
           (line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines() if "==" in line)}
    assert pins == req
    for needed in ("torch", "onnxruntime", "numpy", "tokenizers", "safetensors", "pybase16384", "wetext", "kaldifst",
                   "num2words"):
        assert needed in pins


def test_image_installs_the_text_normaliser_and_checks_its_grammars_load():
    """The image pip-installs the package with its extra "gateway", which brings the extra "server" (wetext and
    num2words among it, pinned by the constraints), and fails to build when the grammars do not load (a wheel missing
    for the image's python, say)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"wetext", "num2words"} <= set(extras["server"]) and "chattts-triton[server]" in extras["gateway"]
    runs = " ".join(i["value"] for i in _parse_dockerfile(DOCKERFILE.read_text()).structure
                    if i["instruction"] == "RUN")
    assert "from chattts_triton.model.spoken import default" in runs and "-c /tmp/constraints.txt" in runs


# --- entry point and `make configure` in the container ----------------------------------------------------------
@pytest.fixture
def fake_python(tmp_path) -> dict[str, object]:
    """A `python3` on PATH that records how the launcher (`-m chattts_triton.serve`) is started and runs
    everything else (configure-repository.sh's repo_config) with the real interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "launcher.json"
    (bin_dir / "python3").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"if sys.argv[1:3] != {LAUNCHER[1:]!r}:\n"
        f"    os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:])\n"
        "env = {k: v for k, v in os.environ.items() if 'ADMIN' in k or 'RESTRICT' in k}\n"
        f"json.dump({{'argv': sys.argv[1:], 'pid': os.getpid(), 'env': env}}, open({str(record)!r}, 'w'))\n"
    )
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATTTS_", "TRITON_ADMIN"))}
    env["PATH"] = f"{bin_dir}:{VENV_BIN}:{env.get('PATH', '')}"
    return {"record": record, "env": env, "tmp": tmp_path}


def _entry(fake, *args, **env):
    e = dict(fake["env"], **{k: str(v) for k, v in env.items()})
    Path(fake["record"]).unlink(missing_ok=True)
    proc = subprocess.Popen([str(DOCKER / "entrypoint.sh"), *args], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def _launched(fake) -> dict:
    return json.loads(Path(fake["record"]).read_text())


def _flags(argv) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def _cmd_for(repo: Path, **ports: int) -> list[str]:
    """The image's CMD with its repository (and ports) replaced."""
    cmd = [f"--repo={repo}" if a == "--repo=/models" else a for a in _image_cmd()]
    for name, port in ports.items():
        cmd = [f"--{name}-port={port}" if a.startswith(f"--{name}-port=") else a for a in cmd]
    return cmd


@pytest.fixture
def repo_copy(tiny_repo, tmp_path) -> Path:
    dst = tmp_path / "models"
    shutil.copytree(tiny_repo, dst)
    return dst


def test_entrypoint_execs_the_image_cmd(fake_python, repo_copy):
    cmd = _cmd_for(repo_copy)
    (r, pid) = _entry(fake_python, *cmd)
    assert r.returncode == 0, r.stderr
    launched = _launched(fake_python)
    assert launched["argv"] == cmd[1:]  # as given: not re-configured, nothing added
    assert launched["pid"] == pid  # exec'd: the launcher is the container's main process and gets SIGTERM
    assert launched["env"] == {}  # no key: the launcher generates one
    flags, server = _split(launched["argv"][2:])
    assert flags["--host"] == "0.0.0.0" and flags["--repo"] == str(repo_copy)
    assert server == ["--strict-readiness=true", "--disable-auto-complete-config"]
    # the key travels by environment (never on a command line the entry point logs); the old name still works
    (r, _) = _entry(fake_python, *cmd, TRITON_ADMIN_KEY="s3cret")
    assert r.returncode == 0 and _launched(fake_python)["env"] == {"CHATTTS_ADMIN_KEY": "s3cret"}
    (r, _) = _entry(fake_python, *cmd, TRITON_ADMIN_KEY="old", CHATTTS_ADMIN_KEY="n3w-k3y")
    assert _launched(fake_python)["env"] == {"CHATTTS_ADMIN_KEY": "n3w-k3y"}
    assert "s3cret" not in r.stdout + r.stderr and "n3w-k3y" not in r.stdout + r.stderr
    # fencing cannot be switched off any more: said, and ignored
    (r, _) = _entry(fake_python, *cmd, CHATTTS_RESTRICT_APIS=0)
    assert r.returncode == 0 and "CHATTTS_RESTRICT_APIS=0 is ignored" in r.stderr
    # --repo as two arguments
    (r, _) = _entry(fake_python, *LAUNCHER, "--host=0.0.0.0", "--repo", str(repo_copy))
    assert r.returncode == 0, r.stderr
    assert _launched(fake_python)["argv"][-2:] == ["--repo", str(repo_copy)]


def test_entrypoint_runs_the_speech_gateway_as_given(fake_python):
    (r, _) = _entry(fake_python, "python3", "-m", "gateway", "--help")
    assert r.returncode == 0 and "usage: python -m gateway" in r.stdout and "--grpc-url" in r.stdout
    assert not Path(fake_python["record"]).exists()  # not mistaken for the launcher


def test_entrypoint_runs_the_wyoming_server_as_given(fake_python):
    (r, _) = _entry(fake_python, "python3", "-m", "gateway.wyoming", "--help")
    assert r.returncode == 0 and "usage: python -m gateway.wyoming" in r.stdout and "--grpc-url" in r.stdout
    assert not Path(fake_python["record"]).exists()  # not mistaken for the launcher


def test_entrypoint_refuses_a_missing_repository(fake_python, tmp_path):
    (r, _) = _entry(fake_python, *_cmd_for(tmp_path / "empty"))
    assert r.returncode == 64
    assert "no exported repository" in r.stderr and "--build-context model_repository" in r.stderr
    assert not Path(fake_python["record"]).exists()
    (r, _) = _entry(fake_python, *LAUNCHER, "--repo", str(tmp_path), "--", f"--repo={tmp_path}")
    assert r.returncode == 64 and "no exported repository" in r.stderr
    (r, _) = _entry(fake_python, *LAUNCHER, "--host=0.0.0.0")
    assert r.returncode == 64 and "needs --repo" in r.stderr
    # the old command would bypass the drain and the watchdog: refused, with the way out
    (r, _) = _entry(fake_python, "tritonserver", f"--model-repository={tmp_path}")
    assert r.returncode == 64 and "through its launcher" in r.stderr and not Path(fake_python["record"]).exists()
    (r, _) = _entry(fake_python, "echo", "passed", "through")
    assert r.returncode == 0 and r.stdout.strip() == "passed through"


def test_entrypoint_is_valid_bash():
    subprocess.run(["bash", "-n", str(DOCKER / "entrypoint.sh")], check=True)
    subprocess.run(["bash", "-n", str(DOCKER / "configure-repository.sh")], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(DOCKER / "entrypoint.sh"), str(DOCKER / "configure-repository.sh")],
                       check=True)


def _instance_groups(repo: Path) -> dict[str, tuple]:
    out = {}
    for m in rc.MODELS:
        cfg = rc.parse_pbtxt((repo / m / "config.pbtxt").read_text())
        (g,) = cfg.instance_group
        out[m] = (mc.ModelInstanceGroup.Kind.Name(g.kind), list(g.gpus), g.count)
    return out


def test_entrypoint_configures_a_writable_view(fake_python, repo_copy, tmp_path):
    before = {p: p.read_bytes() for p in repo_copy.rglob("config.pbtxt")}
    work = tmp_path / "work" / "repository"
    cmd = _cmd_for(repo_copy)
    (r, _) = _entry(fake_python, *cmd, CHATTTS_GPUS="0,1", CHATTTS_INSTANCES=2, CHATTTS_WORK_REPOSITORY=work,
                    CHATTTS_CONFIGURE_ARGS="--max-queue-size 32")
    assert r.returncode == 0, r.stderr
    argv = _launched(fake_python)["argv"]
    assert argv == [f"--repo={work}" if a == f"--repo={repo_copy}" else a for a in cmd[1:]]  # only --repo changed
    groups = _instance_groups(work)
    assert groups[GPT] == ("KIND_GPU", [0, 1], 1)  # one engine per GPU
    assert groups[VOCODER] == ("KIND_GPU", [0, 1], 2)
    assert groups[PREPROCESS] == ("KIND_CPU", [], 4)  # on the CPU: as many as the vocoders on both GPUs
    voc = rc.parse_pbtxt((work / VOCODER / "config.pbtxt").read_text())
    assert voc.dynamic_batching.default_queue_policy.max_queue_size == 32
    man = json.loads((work / MANIFEST).read_text())
    assert man["deployment"]["gpus"] == [0, 1] and man["deployment"]["instances"] == 2
    # weights are links into the source, which is unchanged
    gpt = work / GPT / "1" / "gpt.pt"
    assert gpt.is_symlink() and gpt.resolve() == (repo_copy / GPT / "1" / "gpt.pt").resolve()
    assert {p: p.read_bytes() for p in repo_copy.rglob("config.pbtxt")} == before
    assert not (repo_copy / MANIFEST).is_symlink()
    # CPU: CHATTTS_GPUS empty; --repo as two arguments
    (r, _) = _entry(fake_python, *LAUNCHER, "--repo", str(repo_copy), "--", "--log-info=true", CHATTTS_GPUS="",
                    CHATTTS_WORK_REPOSITORY=work)
    assert r.returncode == 0, r.stderr
    assert _launched(fake_python)["argv"][2:] == ["--repo", str(work), "--", "--log-info=true"]
    assert _instance_groups(work)[VOCODER] == ("KIND_CPU", [], 1)


def _start_container_cmd(tmp_path, **env):
    """The image's CMD through the entry point and the real launcher, on a stand-in NGC /opt/tritonserver."""
    record = tmp_path / "server.json"
    server = make_ngc_tree(tmp_path / "ngc", record)
    repo = make_fake_repository(tmp_path / "models")
    e = launcher_env(tmp_path, server, PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", **env)
    proc = subprocess.Popen([str(DOCKER / "entrypoint.sh"), *_cmd_for(repo, http=0, grpc=0, metrics=0)], env=e,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    while not any(line.startswith("metrics: ") for line in seen):
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            pytest.fail(f"launcher exited {proc.returncode} before ready: {seen} {proc.stderr.read()}")
        seen.append(line)
    return proc, seen, json.loads(record.read_text()), server.resolve().parent.parent


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_container_cmd_serves_through_the_launcher_and_drains_on_sigterm(tmp_path):
    proc, seen, rec, root = _start_container_cmd(tmp_path, TRITON_ADMIN_KEY="legacy-s3cret")
    try:
        assert any(line.startswith("http: 0.0.0.0:") for line in seen)
        flags = _flags(rec["argv"])
        assert flags["--backend-directory"] == str(root / "backends")  # NGC's own, stub in place
        assert flags["--cache-directory"] == str(root / "caches")
        assert rec["ld_library_path"].split(os.pathsep)[0] == str(root / "lib")
        assert flags["--http-address"] == flags["--grpc-address"] == flags["--metrics-address"] == "0.0.0.0"
        assert flags["--model-control-mode"] == "none" and flags["--exit-timeout-secs"] == "60"
        assert flags["--strict-readiness"] == "true" and "--disable-auto-complete-config" in rec["argv"]
        assert flags["--http-restricted-api"] == ("shared-memory,model-repository,logging,"
                                                  "trace:chattts-admin-key=legacy-s3cret")
        assert flags["--grpc-restricted-protocol"] == flags["--http-restricted-api"]
        assert not rec["env_has_admin_key"]  # the models do not see it
        assert (tmp_path / "cache" / "triton-pyenv").is_dir()  # generated files in $CHATTTS_TRITON_CACHE
        proc.send_signal(signal.SIGTERM)  # what docker stop / the kubelet send to the container's main process
        out, err = proc.communicate(timeout=90)
    finally:
        _stop(proc)
    assert proc.returncode == 0, err
    assert "Signal (15) received" in out  # drained, then passed on; the server log goes to stdout
    assert "legacy-s3cret" not in "".join(seen) + out + err


def test_container_cmd_exits_70_when_a_python_stub_dies(tmp_path):
    proc, _, rec, _ = _start_container_cmd(tmp_path)
    try:
        os.kill(rec["stub_pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode == 70, err  # the container exits: Docker --restart / the kubelet restarts it
    assert "python backend stub(s)" in err
    key_file = tmp_path / "home" / ".chattts-triton" / "admin.key"  # no key given: generated, 0600, not printed
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.read_text().strip() not in out + err


def test_container_cmd_stays_up_when_a_process_a_stub_started_ends(tmp_path):
    """On a GPU, torch's inductor starts compile workers in the stubs' process group that end by themselves a
    minute after start-up. The launcher watches the stubs, not the group: the server stays up."""
    proc, _, rec, _ = _start_container_cmd(tmp_path)
    try:
        helper = int(Path(str(tmp_path / "server.json") + ".helper").read_text())
        assert os.getpgid(helper) == os.getpgid(rec["stub_pid"])  # in the group when "ready" was announced
        assert wait_for(lambda: not Path(f"/proc/{helper}").exists(), 10)
        time.sleep(2.0)  # ten polls of the watchdog after the helper ended
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        _stop(proc)
    assert proc.returncode == 0, err
    assert "died" not in err


def test_configure_script_refuses_bad_paths(fake_python, repo_copy, tmp_path):
    script = str(DOCKER / "configure-repository.sh")
    env = fake_python["env"]
    r = subprocess.run([script, str(repo_copy), str(repo_copy / "inside")], env=env, capture_output=True, text=True)
    assert r.returncode == 64 and "outside SRC" in r.stderr
    r = subprocess.run([script, str(tmp_path), str(tmp_path / "x" / "y")], env=env, capture_output=True, text=True)
    assert r.returncode == 64 and "not an exported repository" in r.stderr
    r = subprocess.run([script, str(repo_copy)], env=env, capture_output=True, text=True)
    assert r.returncode == 64 and "usage" in r.stderr


@pytest.mark.e2e
def test_configured_view_is_served_by_tritonserver(tiny_repo, tmp_path):
    """The symlink view `configure-repository.sh` makes (the chart's init step) loads and is ready in Triton."""
    from chattts_triton.launcher.tritonserver import TritonServer

    work = tmp_path / "view"
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", CHATTTS_INSTANCES="2")
    env.pop("CHATTTS_GPUS", None)
    subprocess.run([str(DOCKER / "configure-repository.sh"), str(tiny_repo), str(work)], env=env, check=True,
                   capture_output=True, timeout=120)
    assert _instance_groups(work)[VOCODER] == ("KIND_CPU", [], 2)
    with TritonServer(work, log_file=tmp_path / "triton.log", startup_timeout_s=600) as server:
        import tritonclient.http as http

        client = http.InferenceServerClient(server.http_url.replace("http://", ""))
        assert client.is_server_ready()
        assert client.get_model_config(VOCODER)["instance_group"][0]["count"] == 2


# --- Helm chart ------------------------------------------------------------------------------------------------
K8S_VERSIONS = ("1.27.0", "1.37.0")  # the chart's kubeVersion floor and the newest schemas shipped
RELEASE, NAMESPACE = "tts", "speech"


def render(values: dict | None = None, chart: Path = CHART) -> list[dict]:
    """Every manifest the chart renders, parsed (helm template, offline)."""
    with helm.Chart.load(str(chart)) as c:
        out = c.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def k8s_problems(docs: list[dict]) -> list[str]:
    """Schema errors of the built-in kinds (strict: unknown fields too) and structure errors of the CRDs."""
    problems = []
    for d in docs:
        kind = d.get("kind")
        if d.get("apiVersion", "").startswith("monitoring.coreos.com/"):
            problems += crd_problems(d, docs)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{kind}/{d['metadata'].get('name')} @k8s {version}: {e.message} at {list(e.path)}")
    return problems


def crd_problems(d: dict, docs: list[dict]) -> list[str]:
    problems = []
    if d["apiVersion"] != "monitoring.coreos.com/v1":
        problems.append(f"{d['kind']}: apiVersion {d['apiVersion']}")
    if d["kind"] == "ServiceMonitor":
        svc = _one(docs, "Service")
        sel = d["spec"]["selector"]["matchLabels"]
        if not sel.items() <= svc["metadata"]["labels"].items():
            problems.append("ServiceMonitor selects no label set of the Service")
        ports = {p["name"] for p in svc["spec"]["ports"]}
        for ep in d["spec"]["endpoints"]:
            if ep.get("port") not in ports or ep.get("path") != "/metrics":
                problems.append(f"ServiceMonitor endpoint {ep} is not the Service's metrics port /metrics")
    elif d["kind"] == "PrometheusRule":
        records = {r["record"]: r["expr"] for g in d["spec"]["groups"] for r in g["rules"]}
        ratio = records.get("triton:queue_compute:ratio", "")
        if "nv_inference_queue_duration_us" not in ratio or "nv_inference_compute_infer_duration_us" not in ratio:
            problems.append("PrometheusRule lacks triton:queue_compute:ratio")
    else:
        problems.append(f"unexpected CRD kind {d['kind']}")
    return problems


def _one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, (kind, [d["kind"] for d in docs])
    return found[0]


def _container(dep: dict, name: str = "tritonserver") -> dict:
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


SCENARIOS = {
    "default": None,
    "two-gpus": {"gpu": {"count": 2, "instancesPerGpu": 3}},
    "cpu": {"gpu": {"count": 0}},
    "baked-unconfigured": {"modelRepository": {"source": "image"}, "configure": {"enabled": False}},
    "external-metric-all-extras": {
        "autoscaling": {"metric": {"type": "External"}},
        "podDisruptionBudget": {"enabled": True},
        "monitoring": {"prometheusRule": {"enabled": True}},
        "prometheusAdapter": {"configMap": {"enabled": True, "namespace": "monitoring"}},
        "server": {"adminKeySecret": "triton-admin", "extraArgs": ["--log-info=true"]},
        "imagePullSecrets": [{"name": "ngc"}],
        "podAnnotations": {"a": "b"},
    },
    "wyoming-cpu": {"wyoming": {"enabled": True, "extraArgs": ["--voice", "nova"]}, "gpu": {"count": 0}},
    "fixed-replicas": {"autoscaling": {"enabled": False}, "replicaCount": 3,
                       "monitoring": {"serviceMonitor": {"enabled": False}}},
    "shared-voice-store": {"voiceStore": {"urlSecret": "voice-store"}, "gateway": {"adminKeySecret": "voices-admin"},
                           "server": {"adminKeySecret": "triton-admin"}},
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_chart_renders_valid_kubernetes_manifests(scenario):
    docs = render(SCENARIOS[scenario])
    assert k8s_problems(docs) == []
    kinds = sorted(d["kind"] for d in docs)
    assert "Deployment" in kinds and "Service" in kinds


def test_chart_and_values_files_parse():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "chattts-triton"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    import jsonschema

    jsonschema.validate(values, schema)
    assert set(values) == set(schema["properties"])  # every value documented by the schema


def test_deployment_serves_with_the_image_contract():
    docs = render()
    dep, svc = _one(docs, "Deployment"), _one(docs, "Service")
    pod = dep["spec"]["template"]["spec"]
    c = _container(dep)
    args = c["args"]
    assert "command" not in c  # the image's entry point, which execs the launcher
    assert args[:3] == LAUNCHER
    flags, server = _split(args[3:])
    assert flags["--repo"] == "/var/run/chattts/repository"  # the init step's view
    # same launcher and server flags as the image's CMD
    image_flags, image_server = _split(_image_cmd()[3:])
    for k in ("--host", "--exit-timeout", "--http-port", "--grpc-port", "--metrics-port", "--log-file"):
        assert flags[k] == image_flags[k], k
    assert server == image_server
    startup = c["startupProbe"]
    assert flags["--startup-timeout"] == str(startup["periodSeconds"] * startup["failureThreshold"])
    assert "env" not in c  # no Secret: the launcher generates the admin key
    # ports, probes
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == PORTS
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {**PORTS, "speech": SPEECH_PORT}
    assert all(p["targetPort"] == p["name"] for p in svc["spec"]["ports"])
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # GPUs requested and limited alike
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    # non-root, read-only root, a real /dev/shm
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert vols[mounts["/models"]]["persistentVolumeClaim"]["readOnly"] is True


def test_speech_gateway_runs_beside_the_server_in_each_pod():
    docs = render()
    dep, svc = _one(docs, "Deployment"), _one(docs, "Service")
    server, gw = _container(dep), _container(dep, "gateway")
    assert "command" not in gw and gw["image"] == server["image"]  # the image's entry point execs it as given
    assert gw["args"][:3] == ["python3", "-m", "gateway"]
    flags = _flags(gw["args"])
    server_flags, _ = _split(server["args"][3:])
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == str(SPEECH_PORT)
    assert flags["--grpc-url"] == f"127.0.0.1:{server_flags['--grpc-port']}"  # this pod's Triton
    assert flags["--repo"] == server_flags["--repo"]  # the voices of the repository served
    assert "--require-api-key" not in gw["args"] and "env" not in gw
    assert {p["name"]: p["containerPort"] for p in gw["ports"]} == {"speech": SPEECH_PORT}
    speech = next(p for p in svc["spec"]["ports"] if p["name"] == "speech")
    assert (speech["port"], speech["targetPort"]) == (SPEECH_PORT, "speech")
    assert gw["readinessProbe"]["httpGet"] == {"path": "/health", "port": "speech"}  # follows Triton's readiness
    assert gw["livenessProbe"]["tcpSocket"] == {"port": "speech"}  # not Triton's: a loading server restarts nothing
    assert gw["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in server["volumeMounts"]} >= {m["mountPath"] for m in gw["volumeMounts"]}
    assert "nvidia.com/gpu" not in gw["resources"].get("limits", {})
    monitor = _one(docs, "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics", "speech"]


def test_speech_gateway_keys_and_switch():
    values = {"gateway": {"apiKeysSecret": "speech-keys", "requireApiKey": True, "extraArgs": ["--pause-ms", "300"]}}
    gw = _container(_one(render(values), "Deployment"), "gateway")
    assert gw["env"] == [{"name": "CHATTTS_GATEWAY_API_KEYS",
                          "valueFrom": {"secretKeyRef": {"name": "speech-keys", "key": "api-keys"}}}]
    assert gw["args"][-3:] == ["--require-api-key", "--pause-ms", "300"]
    docs = render({"gateway": {"enabled": False}})
    assert k8s_problems(docs) == []
    dep = _one(docs, "Deployment")
    assert [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]] == ["tritonserver"]
    assert {p["name"] for p in _one(docs, "Service")["spec"]["ports"]} == set(PORTS)
    assert [e["port"] for e in _one(docs, "ServiceMonitor")["spec"]["endpoints"]] == ["metrics"]


def test_the_voice_store_reaches_the_models_and_the_gateway_and_writes_need_the_admin_key():
    """voiceStore names one store for Triton's models and the gateway of every pod (CHATTTS_VOICE_STORE, from a Secret
    where the URL holds a password); gateway.adminKeySecret is the key POST/DELETE /v1/audio/voices need."""
    values = {"voiceStore": {"url": "redis://voices-redis:6379/0"}, "wyoming": {"enabled": True}}
    dep = _one(render(values), "Deployment")
    for name in ("tritonserver", "gateway", "wyoming"):
        assert _env(_container(dep, name)) == {"CHATTTS_VOICE_STORE": "redis://voices-redis:6379/0"}, name
    docs = render(SCENARIOS["shared-voice-store"])
    dep = _one(docs, "Deployment")
    server, gw = _container(dep), _container(dep, "gateway")
    secret = {"secretKeyRef": {"name": "voice-store", "key": "url"}}
    assert {e["name"]: e["valueFrom"] for e in server["env"]} == {
        "CHATTTS_ADMIN_KEY": {"secretKeyRef": {"name": "triton-admin", "key": "admin-key"}},
        "CHATTTS_VOICE_STORE": secret}
    assert {e["name"]: e["valueFrom"] for e in gw["env"]} == {
        "CHATTTS_ADMIN_KEY": {"secretKeyRef": {"name": "voices-admin", "key": "admin-key"}},
        "CHATTTS_VOICE_STORE": secret}
    with pytest.raises(Exception, match="voiceStore"):  # the schema: a URL of a known store or nothing
        render({"voiceStore": {"url": "mysql://h/db"}})


def test_wyoming_server_runs_beside_the_server_in_each_pod_when_switched_on():
    docs = render({"wyoming": {"enabled": True, "extraArgs": ["--seed", "7"]}})
    dep, svc = _one(docs, "Deployment"), _one(docs, "Service")
    server, wy = _container(dep), _container(dep, "wyoming")
    assert "command" not in wy and wy["image"] == server["image"]  # the image's entry point execs it as given
    assert wy["args"][:3] == ["python3", "-m", "gateway.wyoming"] and wy["args"][-2:] == ["--seed", "7"]
    flags = _flags(wy["args"])
    server_flags, _ = _split(server["args"][3:])
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == str(WYOMING_PORT)
    assert flags["--grpc-url"] == f"127.0.0.1:{server_flags['--grpc-port']}"  # this pod's Triton
    assert flags["--repo"] == server_flags["--repo"]  # describe lists the voices of the repository served
    assert {p["name"]: p["containerPort"] for p in wy["ports"]} == {"wyoming": WYOMING_PORT}
    port = next(p for p in svc["spec"]["ports"] if p["name"] == "wyoming")
    assert (port["port"], port["targetPort"], port["protocol"]) == (WYOMING_PORT, "wyoming", "TCP")
    assert wy["readinessProbe"]["tcpSocket"] == wy["livenessProbe"]["tcpSocket"] == {"port": "wyoming"}
    assert wy["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in server["volumeMounts"]} >= {m["mountPath"] for m in wy["volumeMounts"]}
    assert "nvidia.com/gpu" not in wy["resources"].get("limits", {})
    assert [e["port"] for e in _one(docs, "ServiceMonitor")["spec"]["endpoints"]] == ["metrics", "speech"]  # no metrics
    # the image's Wyoming server takes every flag the chart gives it
    from gateway.wyoming import build_parser

    parsed = build_parser().parse_args(wy["args"][3:])
    assert (parsed.port, parsed.grpc_url, parsed.seed) == (WYOMING_PORT, flags["--grpc-url"], 7)


def test_wyoming_server_is_off_by_default():
    docs = render()
    dep, svc = _one(docs, "Deployment"), _one(docs, "Service")
    assert [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]] == ["tritonserver", "gateway"]
    assert "wyoming" not in {p["name"] for p in svc["spec"]["ports"]}


def termination_problems(dep: dict, exit_timeout: int, margin: int) -> list[str]:
    pod = dep["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    flags, _ = _split(_container(dep)["args"])
    problems = []
    if flags.get("--exit-timeout") != str(exit_timeout):
        problems.append(f"--exit-timeout={flags.get('--exit-timeout')} != {exit_timeout}")
    # the launcher's drain (up to the exit timeout), then Triton's (as long again), then the process exit
    if grace < 2 * exit_timeout + margin:
        problems.append(f"terminationGracePeriodSeconds {grace} < 2 x exit timeout {exit_timeout} + margin {margin}")
    return problems


@pytest.mark.parametrize("exit_timeout, margin", [(60, 30), (300, 45), (0, 10)])
def test_grace_period_covers_the_exit_timeout(exit_timeout, margin):
    dep = _one(render({"server": {"exitTimeoutSeconds": exit_timeout, "terminationMarginSeconds": margin}}),
               "Deployment")
    assert termination_problems(dep, exit_timeout, margin) == []
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 2 * exit_timeout + margin


def test_grace_period_check_rejects_a_short_grace():
    dep = _one(render(), "Deployment")
    dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30  # kubelet default: kills mid-drain
    assert termination_problems(dep, 60, 30)
    dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 90  # Triton's drain alone
    assert termination_problems(dep, 60, 30)


def test_admin_key_comes_from_the_secret_by_environment():
    c = _container(_one(render({"server": {"adminKeySecret": "tts-admin"}}), "Deployment"))
    assert c["env"] == [{"name": "CHATTTS_ADMIN_KEY",
                         "valueFrom": {"secretKeyRef": {"name": "tts-admin", "key": "admin-key"}}}]
    assert not any("admin" in a.lower() for a in c["args"])
    with pytest.raises(helm.HelmError, match="restrictAdminApis"):
        render({"server": {"restrictAdminApis": False}})


def test_a_compile_cache_claim_holds_torch_compiles_caches_for_the_server_only():
    """With compileCache.pvc.claimName, tritonserver's container (whose python stubs inherit its environment) finds
    inductor's and Triton's caches on the claim; without one, neither the variables nor the volume appear."""
    docs = render({"compileCache": {"pvc": {"claimName": "tts-compile"}, "mountPath": "/cache"}})
    assert k8s_problems(docs) == []
    dep = _one(docs, "Deployment")
    c = _container(dep)
    assert {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/cache/inductor"} in c["env"]
    assert {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"} in c["env"]
    assert {"name": "compile-cache", "mountPath": "/cache"} in c["volumeMounts"]
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "tts-compile"}} in pod["volumes"]
    others = [x for x in pod["containers"] if x["name"] != c["name"]]
    assert others and not any("compile-cache" in str(x.get("volumeMounts")) for x in others)
    plain = _one(render(), "Deployment")
    assert "CACHE_DIR" not in str(_container(plain).get("env"))
    assert "compile-cache" not in str(plain["spec"]["template"]["spec"]["volumes"])
    with pytest.raises(helm.HelmError, match="mountPath"):
        render({"compileCache": {"pvc": {"claimName": "x"}, "mountPath": "relative/path"}})


def test_server_extra_args_go_to_tritonserver():
    c = _container(_one(render(SCENARIOS["external-metric-all-extras"]), "Deployment"))
    flags, server = _split(c["args"])
    assert server[-1] == "--log-info=true" and "--log-info" not in flags


@pytest.mark.parametrize("gpus, instances", [(1, 1), (2, 3), (4, 2), (0, 2)])
def test_init_step_is_make_configure_for_the_pod(gpus, instances):
    dep = _one(render({"gpu": {"count": gpus, "instancesPerGpu": instances},
                       "configure": {"extraArgs": ["--max-queue-size", "128"]}}), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["/opt/chattts/bin/configure-repository.sh"]
    assert init["args"] == ["/models", "/var/run/chattts/repository"]
    env = _env(init)
    assert env["CHATTTS_GPUS"] == ",".join(str(i) for i in range(gpus))
    assert env["CHATTTS_INSTANCES"] == str(instances)
    assert env["CHATTTS_CONFIGURE_ARGS"] == "--max-queue-size 128"
    res = _container(dep)["resources"]
    if gpus:
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == gpus
    else:
        assert "nvidia.com/gpu" not in res.get("limits", {}) and "nvidia.com/gpu" not in res.get("requests", {})
    # the init step writes where the server reads, and both see the source at the same path (symlinks)
    init_mounts = {m["mountPath"] for m in init["volumeMounts"]}
    main_mounts = {m["mountPath"] for m in _container(dep)["volumeMounts"]}
    assert {"/models", "/var/run/chattts"} <= init_mounts & main_mounts


def test_baked_repository_without_configure_serves_models_directly():
    dep = _one(render(SCENARIOS["baked-unconfigured"]), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert _split(_container(dep)["args"])[0]["--repo"] == "/models"
    assert not any("persistentVolumeClaim" in v for v in pod["volumes"])


def _adapter_config(docs) -> dict:
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("prometheus-adapter"))
    return yaml.safe_load(cm["data"]["config.yaml"])


@pytest.mark.parametrize("metric_type", ["Pods", "External"])
def test_hpa_reads_the_metric_the_adapter_rule_serves(metric_type):
    docs = render({"autoscaling": {"metric": {"type": metric_type}, "minReplicas": 2, "maxReplicas": 6},
                   "prometheusAdapter": {"configMap": {"enabled": True}}})
    hpa, dep = _one(docs, "HorizontalPodAutoscaler"), _one(docs, "Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert "replicas" not in dep["spec"]  # the HPA owns it
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == metric_type
    spec = metric["pods"] if metric_type == "Pods" else metric["external"]
    config = _adapter_config(docs)
    (rule,) = config["rules" if metric_type == "Pods" else "externalRules"]
    assert spec["metric"]["name"] == rule["name"]["as"] == "triton_queue_compute_ratio"
    query = rule["metricsQuery"]
    assert "nv_inference_queue_duration_us" in query and "nv_inference_compute_infer_duration_us" in query
    assert query.index("nv_inference_queue_duration_us") < query.index("/") < query.index(
        "nv_inference_compute_infer_duration_us")  # queue over compute
    assert 'model=~"chattts_.+"' in query  # composing models, not the ensemble twice
    assert re.search(r"nv_inference_queue_duration_us", rule["seriesQuery"])
    overrides = rule["resources"]["overrides"]
    if metric_type == "Pods":
        assert overrides["pod"] == {"resource": "pod"}
        assert spec["target"] == {"type": "AverageValue", "averageValue": "1000m"}
    else:
        assert "pod" not in overrides
        assert spec["target"] == {"type": "Value", "value": "1000m"}  # a ratio: not divided by pod count
        assert spec["metric"]["selector"]["matchLabels"]["service"] == _one(docs, "Service")["metadata"]["name"]


def test_notes_print_the_adapter_rule_when_no_configmap():
    with helm.Chart.load(str(CHART)) as c:
        notes = c.render(None, name=RELEASE, namespace=NAMESPACE)["chattts-triton/templates/NOTES.txt"]
    rule = yaml.safe_load(notes[notes.index("- seriesQuery"):])
    assert rule[0]["name"]["as"] == "triton_queue_compute_ratio"


def test_helm_lint_is_clean():
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- the validation rejects broken charts ------------------------------------------------------------------------
def _broken_chart(tmp_path, template: str, old: str, new: str) -> Path:
    dst = tmp_path / "chattts-triton"
    shutil.copytree(CHART, dst)
    path = dst / "templates" / template
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return dst


@pytest.mark.parametrize(
    "template, old, new, complaint",
    [
        ("deployment.yaml", "containerPort: {{ int .Values.service.ports.http }}",
         "containerPorts: {{ int .Values.service.ports.http }}", "containerPort"),  # typo'd field
        ("deployment.yaml", "periodSeconds: {{ .Values.probes.readiness.periodSeconds }}",
         'periodSeconds: "{{ .Values.probes.readiness.periodSeconds }}"', "is not of type 'integer'"),
        ("hpa.yaml", "averageValue: {{ $m.target | quote }}", "averageValues: {{ $m.target | quote }}",
         "averageValues"),
        ("service.yaml", "  selector:", "  selectors:", "selectors"),
        ("servicemonitor.yaml", "- port: metrics", "- port: prometheus", "metrics port"),
    ],
)
def test_validation_rejects_a_broken_template(tmp_path, template, old, new, complaint):
    docs = render(chart=_broken_chart(tmp_path, template, old, new))
    problems = k8s_problems(docs)
    assert problems and any(complaint in p for p in problems), problems


def test_template_errors_and_bad_values_fail_rendering(tmp_path):
    broken = _broken_chart(tmp_path, "deployment.yaml",
                           "{{ include \"chattts-triton.terminationGracePeriodSeconds\" . }}",
                           "{{ include \"chattts-triton.terminationGracePeriodSecond\" . }}")
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSecond"):
        render(chart=broken)
    with pytest.raises(helm.HelmValuesError, match="gpu/count"):
        render({"gpu": {"count": "two"}})
    with pytest.raises(helm.HelmValuesError, match="gpus"):
        render({"gpus": 2})  # a typo'd key is refused, not ignored
    with pytest.raises(helm.HelmError, match="minReplicas"):
        render({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}})
    with pytest.raises(helm.HelmError, match="/models"):
        render({"modelRepository": {"source": "image", "mountPath": "/srv/models"}})


def test_adapter_metric_names_are_configurable():
    """For when the GPT engine exports its own queue/compute counters (see the chart README)."""
    docs = render({"prometheusAdapter": {"configMap": {"enabled": True}, "queueMetric": "chattts_engine_queue_us",
                                         "computeMetric": "chattts_engine_compute_us", "models": "chattts_gpt"}})
    (rule,) = _adapter_config(docs)["rules"]
    assert rule["seriesQuery"].startswith("chattts_engine_queue_us{")
    assert "rate(chattts_engine_queue_us{" in rule["metricsQuery"]
    assert "rate(chattts_engine_compute_us{" in rule["metricsQuery"]
    assert "nv_inference" not in rule["metricsQuery"] and 'model=~"chattts_gpt"' in rule["metricsQuery"]
    with pytest.raises(helm.HelmValuesError):
        render({"prometheusAdapter": {"queueMetric": "bad metric{}"}})


def test_chart_readme_shows_the_rule_the_chart_renders():
    docs = render({"prometheusAdapter": {"configMap": {"enabled": True}}})
    readme = (CHART / "README.md").read_text()
    snippet = re.search(r"```yaml\n(- seriesQuery.*?)```", readme, re.S).group(1)
    assert yaml.safe_load(snippet) == _adapter_config(docs)["rules"]
