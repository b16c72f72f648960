"""The voice store shared for real (#31): one tritonserver on the tiny weights and two gateways (`python -m gateway`)
over one redis-server (tests/conftest.py starts it), named every way a deployment names it: the server through the
repository's `voice_store` setting (configure --voice-store: config.pbtxt's parameter), the first gateway through env
CHATTTS_VOICE_STORE (Helm's way), the second through `--repo` (the repository's setting). A voice POSTed to one gateway
is spoken by the other through OpenAI's client and by a direct gRPC call naming it (chattts_preprocess and
chattts_stream read the store) after the store's poll interval, survives the gateway's restart, and once DELETEd is
gone everywhere; a recording POSTed is the server's own encoding of it; a lexicon entry PUT on one gateway is what the
other gateway's spoken text and both models' SPOKEN_TEXT say, until it is DELETEd.

One tritonserver in all (its start is most of this file's time): SQLite and PostgreSQL are tested against a real file
and a real server in tests/test_stores.py (two views each: a write of one is what the other reads next), an SQLite
store read by chattts_preprocess in tests/test_lexicon.py, and every store reaches the models by the same setting and
environment variable as Redis does here."""

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
    url: str
    server: TritonServer
    repo: Path
    folder: Path
    gateways: list[Gateway]


class Gateway:
    """`python -m gateway` (one worker) over the server at `grpc_url`, the store named by `env` or `args`."""

    def __init__(self, folder: Path, grpc_url: str, env: dict[str, str], args: list[str],
                 admin_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"gateway-{self.port}.log"
        self.started_with = (folder, grpc_url, env, args, admin_key)  # what a restart starts again
        env = {**env, **({"CHATTTS_ADMIN_KEY": admin_key} if admin_key else {})}
        self.admin = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "--grpc-url", grpc_url, "--port",
                                          str(self.port), "--workers", "1", *args], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, preexec_fn=set_parent_death_signal)

    def restarted(self) -> Gateway:
        self.stop()
        return Gateway(*self.started_with).wait()

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
def deployment(tiny_repo, redis_url, tmp_path_factory):
    """The server reading the store through the repository's setting, and two gateways started beside it (their start
    overlaps the server's): the first with an admin key (env CHATTTS_ADMIN_KEY) and the store through env, the second
    without a key (it takes writes on 127.0.0.1) and the store through --repo."""
    from chattts_triton.triton.repo_config import main as configure

    folder = tmp_path_factory.mktemp("voices-e2e")
    url = redis_url + "?prefix=e2e"
    repo = folder / "repo"
    shutil.copytree(tiny_repo, repo)
    assert configure(["--repo", str(repo), "--voice-store", url]) == 0
    env = {k: v for k, v in os.environ.items() if k not in (VOICE_STORE_ENV, "CHATTTS_ADMIN_KEY")}
    grpc_url = f"127.0.0.1:{free_port()}"
    gateways = [Gateway(folder, grpc_url, {**env, VOICE_STORE_ENV: url}, [], ADMIN_KEY),
                Gateway(folder, grpc_url, env, ["--repo", str(repo)])]
    try:
        with TritonServer(repo, log_file=folder / "tritonserver.log", startup_timeout_s=600, env=env,
                          grpc_port=int(grpc_url.rsplit(":", 1)[1])) as server:
            for g in gateways:
                g.wait()
            yield Deployment(url, server, repo, folder, gateways)
    finally:
        for g in gateways:
            if g.proc.poll() is None:
                g.stop()


@pytest.fixture(scope="module")
def gateways(deployment):
    return deployment.gateways


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
    name = "narrator"
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

    restarted = one.restarted()  # a restarted gateway reads the store again
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
    name = "clip"
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


def test_a_lexicon_entry_put_on_one_gateway_is_what_the_other_and_both_models_say_until_deleted(deployment, gateways,
                                                                                                  grpc):
    from urllib.parse import quote

    one, two = gateways
    text, fixed = "我在重庆用AWS。", {"seed": 2, "max_new_tokens": 8, "min_new_tokens": 8}

    def gateway_said() -> str:  # what the server read, as the gateway's captioned answer shows it
        status, body = two.request("POST", "/v1/audio/speech/captioned", {"model": "chattts", "input": text,
                                                                          "voice": "alloy", **fixed})
        assert status == 200, body
        return body["segments"][0]["spoken_text"]

    def grpc_said(stream: bool) -> str:
        told: list[str] = []
        if stream:  # chattts_stream
            list(grpc.stream(text, voice_from_first=False, on_spoken_text=told.append, split=False, **fixed))
        else:  # chattts_preprocess
            grpc.synthesize(text, on_spoken_text=told.append, split=False, **fixed)
        return told[0]

    before = gateway_said()
    assert "重庆" in before and grpc_said(False) == grpc_said(True) == before
    entry = {"word": "重庆", "say": "虫庆"}
    assert one.request("PUT", "/v1/audio/lexicon", entry)[0] == 401  # gateway one has an admin key
    status, made = one.request("PUT", "/v1/audio/lexicon", entry, headers=one.admin)
    assert status == 201 and made["say"] == "虫庆", made
    time.sleep(POLL_S)  # every reader looks at the store's generation again after this
    after = before.replace("重庆", "虫庆")
    assert gateway_said() == grpc_said(False) == grpc_said(True) == after
    assert two.request("GET", "/v1/audio/lexicon")[1]["entries"] == [{**made}]
    status, body = two.request("PUT", "/v1/audio/lexicon", {"word": "重 庆", "say": "x"})  # refused, nothing changes
    assert status == 400 and body["error"]["param"] == "word", body
    assert two.request("DELETE", f"/v1/audio/lexicon/{quote('重庆')}")[0] == 200  # gateway two: loopback, no key
    time.sleep(POLL_S)
    assert gateway_said() == grpc_said(True) == before
