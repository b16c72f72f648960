"""The voice store shared for real (#31 item 1): for each store kind (an SQLite file named by the repository's
`voice_store` setting, a redis-server and a PostgreSQL server named by env CHATTTS_VOICE_STORE; tests/conftest.py starts
them) one tritonserver on the tiny weights and two gateways (`python -m gateway`) over the same store. A voice POSTed to
one gateway is spoken by the other through OpenAI's client and by a direct gRPC call naming it (chattts_preprocess and
chattts_stream read the store) after the store's poll interval, survives the gateway's restart, and once DELETEd is
gone everywhere; a recording POSTed is the server's own encoding of it."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from chattts_triton.config import VOICE_STORE_ENV
from chattts_triton.launcher.tritonserver import TritonServer, free_port, set_parent_death_signal
from chattts_triton.runtime.stores import POLL_S
from client import ChatTTSClient
from client.errors import ChatTTSError
from gateway.audio import to_int16

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
FIXED = {"max_new_tokens": 20, "min_new_tokens": 20, "prompt": "[speed_5]"}
TEXT = "Hello world."
ADMIN_KEY = "e2e-admin-key"


@dataclass
class Deployment:
    kind: str
    url: str
    server: TritonServer
    repo: Path
    folder: Path
    gateway_args: list[str]
    env: dict[str, str]


@pytest.fixture(scope="module", params=["sqlite", "redis", "postgresql"])
def deployment(request, tiny_repo, tmp_path_factory):
    """One tritonserver reading the store: the SQLite one through the repository's setting (configure
    --voice-store: config.pbtxt's parameter), the servers through the environment."""
    from chattts_triton.triton.repo_config import main as configure

    kind = request.param
    folder = tmp_path_factory.mktemp(f"voices-{kind}")
    env = {k: v for k, v in os.environ.items() if k not in (VOICE_STORE_ENV, "CHATTTS_ADMIN_KEY")}
    repo = tiny_repo
    if kind == "sqlite":
        url = f"sqlite://{folder}/voices.db"
        repo = folder / "repo"
        shutil.copytree(tiny_repo, repo)
        assert configure(["--repo", str(repo), "--voice-store", url]) == 0
        gateway_args = ["--repo", str(repo)]  # the gateway reads the repository's setting too
    else:
        url = request.getfixturevalue("redis_url" if kind == "redis" else "postgres_url")
        if kind == "redis":
            url += "?prefix=e2e"
        env[VOICE_STORE_ENV] = url
        gateway_args = ["--voice-store", url]
    with TritonServer(repo, log_file=folder / "tritonserver.log", startup_timeout_s=600, env=env) as server:
        yield Deployment(kind, url, server, Path(repo), folder, gateway_args, env)


class Gateway:
    """`python -m gateway` (one worker) over the deployment's server and store."""

    def __init__(self, d: Deployment, admin_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = d.folder / f"gateway-{self.port}.log"
        env = {**d.env, **({"CHATTTS_ADMIN_KEY": admin_key} if admin_key else {})}
        self.admin = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "--grpc-url", d.server.grpc_url, "--port",
                                          str(self.port), "--workers", "1", *d.gateway_args], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, preexec_fn=set_parent_death_signal)

    def wait(self) -> Gateway:
        deadline = time.monotonic() + 120
        while self.request("GET", "/health")[0] != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(30) in (0, -15), self.log.read_text()

    def request(self, method: str, path: str, body: dict | None = None, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict]:
        if body is not None:
            data, headers = json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if r.headers.get("content-type", "").startswith("application/json")
                                  else {"bytes": raw})
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except OSError:
            return 0, {}

    def speech(self, voice: str, seed: int) -> np.ndarray:
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        extra = {k: v for k, v in FIXED.items() if k != "prompt"}
        return np.frombuffer(client.audio.speech.create(model="chattts", voice=voice, input=TEXT, response_format="pcm",
                                                        extra_body={**extra, "seed": seed, "stream": False}).content,
                             "<i2")


@pytest.fixture(scope="module")
def gateways(deployment):
    """Two gateways over one store: the first with an admin key (env CHATTTS_ADMIN_KEY), the second without (it takes
    writes on 127.0.0.1)."""
    started = [Gateway(deployment, ADMIN_KEY), Gateway(deployment)]
    for g in started:
        g.wait()
    yield started
    for g in started:
        if g.proc.poll() is None:
            g.stop()


@pytest.fixture(scope="module")
def grpc(deployment):
    with ChatTTSClient(deployment.server.grpc_url) as c:
        yield c


def same_pcm(got: np.ndarray, ref: np.ndarray) -> bool:
    """The same call's 16-bit audio, within what a last-bit difference of the server's float audio changes
    (tests/test_gateway_e2e.py same_raw)."""
    from tests.test_gateway_e2e import same_raw

    return same_raw(got.tobytes(), ref.tobytes(), "pcm")


def multipart(fields: dict[str, str], audio: bytes) -> tuple[bytes, dict[str, str]]:
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="audio"; filename="clip.wav"\r\n'
                 f'Content-Type: audio/wav\r\n\r\n'.encode() + audio + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), {"Content-Type": "multipart/form-data; "
                                                                              f"boundary={boundary}"}


def test_a_voice_posted_to_one_gateway_is_spoken_by_the_other_and_by_grpc_survives_a_restart_and_is_deleted(
        deployment, gateways, grpc):
    one, two = gateways
    name = f"narrator-{deployment.kind}"
    with pytest.raises(ChatTTSError, match=f"'{name}' is not a voice"):  # the server has looked at the store already
        grpc.synthesize(TEXT, voice=name, seed=3, split=False, **FIXED)
    assert one.request("POST", "/v1/audio/voices", {"name": name, "seed": 4242})[0] == 401  # gateway one has a key
    status, made = one.request("POST", "/v1/audio/voices", {"name": name, "seed": 4242, "description": "e2e"},
                               headers=one.admin)
    assert status == 201 and made["seed"] == 4242, made
    time.sleep(POLL_S)  # every reader looks at the store's generation again after this (docs/voices.md)
    by_seed = grpc.synthesize(TEXT, voice="4242", seed=3, split=False, **FIXED)
    # chattts_preprocess
    assert np.array_equal(grpc.synthesize(TEXT, voice=name, seed=3, split=False, **FIXED), by_seed)
    streamed = [np.concatenate(list(grpc.stream(TEXT, voice=v, seed=3, split=False, **FIXED))) for v in (name, "4242")]
    assert np.array_equal(*streamed)  # chattts_stream reads the store too
    spoken = two.speech(name, seed=3)
    assert same_pcm(spoken, to_int16(by_seed)), "the other gateway's speech is not the stored voice's"
    assert two.request("GET", f"/v1/audio/voices/{name}")[1]["description"] == "e2e"

    one.stop()  # a restarted gateway reads the store again
    restarted = Gateway(deployment, ADMIN_KEY).wait()
    gateways[0] = restarted
    assert name in [v["id"] for v in restarted.request("GET", "/v1/audio/voices")[1]["voices"]]
    assert same_pcm(restarted.speech(name, seed=3), spoken)

    assert two.request("DELETE", f"/v1/audio/voices/{name}") == (200, {"id": name, "object": "voice", "deleted": True})
    assert restarted.request("GET", f"/v1/audio/voices/{name}")[0] == 404
    time.sleep(POLL_S)
    with pytest.raises(ChatTTSError, match=f"'{name}' is not a voice"):
        grpc.synthesize(TEXT, voice=name, seed=3, split=False, **FIXED)
    status, body = restarted.request("POST", "/v1/audio/speech", {"model": "chattts", "input": TEXT, "voice": name})
    assert status == 400 and body["error"]["param"] == "voice", body


def test_a_recording_posted_is_the_servers_encoding_of_it_and_speaks_through_both(deployment, gateways, grpc):
    from chattts_triton.runtime import voices as V
    from tests.test_voices_http import wav_bytes

    one, two = gateways
    name = f"clip-{deployment.kind}"
    audio = wav_bytes(1.5)
    data, headers = multipart({"name": name, "transcript": "参考音频"}, audio)
    status, made = two.request("POST", "/v1/audio/voices", data=data, headers=headers)
    assert status == 201, made
    stored = V.encode_reference(deployment.repo, V.decode_reference_audio(io.BytesIO(audio)))
    assert made["sample"] == stored and made["transcript"] == "参考音频"  # the voices CLI's encoding of the file
    time.sleep(POLL_S)
    by_sample = grpc.synthesize(TEXT, speaker_sample=stored, speaker_text="参考音频", seed=5, split=False,
                                voice_from_first=False, **FIXED)
    assert np.array_equal(grpc.synthesize(TEXT, voice=name, seed=5, split=False, voice_from_first=False, **FIXED),
                          by_sample)
    assert same_pcm(one.speech(name, seed=5), to_int16(by_sample))
    bad, headers = multipart({"name": f"{name}-2", "transcript": "参考音频"}, b"RIFF not really a wav" * 50)
    status, body = two.request("POST", "/v1/audio/voices", data=bad, headers=headers)
    assert status == 400 and body["error"]["param"] == "audio", body
    assert two.request("DELETE", f"/v1/audio/voices/{name}", headers=two.admin)[0] == 200
