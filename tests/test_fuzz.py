"""Fuzzing the served `chattts` ensemble with hypothesis: no input may crash or wedge the server.

Every example must end in either a success with finite audio or a clean client error: HTTP 400
(or gRPC INVALID_ARGUMENT) for bad input. One exception, not ours: Triton 2.51's HTTP frontend answers
500 to some malformed JSON bodies it cannot parse (e.g. "Unable to parse 'data': Shape does not match
true shape of 'data' field") before any model sees them; such a 500 is accepted only when its message
is one of those frontend parse errors, never one from a model ("in ensemble", "internal error").
503 cannot happen here (one request at a time, far below any queue bound). After every example the
server must still be live.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from chattts_triton.config import ENSEMBLE_INPUTS
from tests.reliability_util import contract_inputs, http_status

pytestmark = pytest.mark.e2e

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
WIRE_TYPES = ["BYTES", "INT64", "INT32", "FP32", "FP64", "BOOL", "UINT8", "INT8", "FP16"]
NAMES = sorted(ENSEMBLE_INPUTS) + ["AUDIO", "VOLUME", ""]
CHEAP = {"name": "MAX_NEW_TOKENS", "datatype": "INT32", "shape": [1, 1], "data": [2]}  # cap generation cost


FRONTEND_PARSE_ERRORS = ("Unable to parse", "failed to parse the request JSON")
FRONTEND_500S: set = set()
SEEN: dict = {}  # outcome -> count, to show the fuzzing reached both success and rejection


def _seen(key: str) -> None:
    SEEN[key] = SEEN.get(key, 0) + 1


def _json_value(datatype):
    if datatype == "BYTES":
        return st.text(max_size=12)
    if datatype == "BOOL":
        return st.booleans()
    if datatype.startswith("FP"):
        return st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=32), st.sampled_from(["NaN", "Inf"]))
    return st.integers(-(1 << 40), 1 << 40)


@st.composite
def infer_bodies(draw):
    tensors = []
    for _ in range(draw(st.integers(0, 4))):
        datatype = draw(st.sampled_from(WIRE_TYPES))
        shape = draw(st.lists(st.integers(-1, 3), min_size=0, max_size=3))
        n = int(np.prod([max(d, 0) for d in shape])) if shape else 1
        if draw(st.booleans()):  # data that matches the shape, else whatever
            data = draw(st.lists(_json_value(datatype), min_size=n, max_size=n))
        else:
            data = draw(st.one_of(st.lists(_json_value(datatype), max_size=5), _json_value(datatype), st.none()))
        tensors.append({"name": draw(st.sampled_from(NAMES)), "datatype": datatype, "shape": shape, "data": data})
    if draw(st.booleans()):
        tensors.append({"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [draw(st.text(max_size=20))]})
    if not any(t["name"] == "MAX_NEW_TOKENS" for t in tensors):
        tensors.append(CHEAP)
    body = {"inputs": tensors}
    if draw(st.booleans()):
        body["outputs"] = [{"name": draw(st.sampled_from(["AUDIO", "NOPE"]))}]
    return json.dumps(body, allow_nan=True).encode()


def _check_http(server, body: bytes, content_type="application/json"):
    status, payload = http_status(server.http_url, "/v2/models/chattts/infer", "POST", body,
                                  headers={"Content-Type": content_type}, timeout_s=60)
    if status == 500:  # Triton's JSON parser, before any model (see the module docstring)
        msg = json.loads(payload).get("error", "")
        assert msg.startswith(FRONTEND_PARSE_ERRORS) and "ensemble" not in msg, (msg, body[:300])
        FRONTEND_500S.add(msg[:80])
    else:
        assert status in (200, 400), (status, payload[:300], body[:300])
    _seen(f"http {status}")
    if status == 200:
        out = json.loads(payload)["outputs"]
        audio = np.asarray(next(o for o in out if o["name"] == "AUDIO")["data"], np.float32)
        assert np.isfinite(audio).all()
    assert http_status(server.http_url, "/v2/health/live")[0] == 200


@given(body=infer_bodies())
@FUZZ
def test_fuzz_http_json_bodies(served_tiny, body):
    _check_http(served_tiny, body)


@given(body=st.binary(max_size=512))
@settings(FUZZ, max_examples=60)
def test_fuzz_http_raw_bytes(served_tiny, body):
    _check_http(served_tiny, body)


@given(header_len=st.integers(0, 64), tail=st.binary(max_size=64), text=st.text(max_size=8))
@settings(FUZZ, max_examples=40)
def test_fuzz_http_binary_extension(served_tiny, header_len, tail, text):
    """The binary tensor extension: a JSON header whose sizes lie about the bytes that follow."""
    header = json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1],
                                     "parameters": {"binary_data_size": header_len}}, CHEAP]}).encode()
    raw = len(text.encode()).to_bytes(4, "little") + text.encode() + tail
    status, payload = http_status(served_tiny.http_url, "/v2/models/chattts/infer", "POST", header + raw,
                                  headers={"Content-Type": "application/octet-stream",
                                           "Inference-Header-Content-Length": str(len(header))}, timeout_s=60)
    assert status in (200, 400), (status, payload[:300])
    assert http_status(served_tiny.http_url, "/v2/health/live")[0] == 200


def _strings():
    # any unicode incl. controls, brackets, lone surrogates (sent as surrogatepass bytes), or raw bytes
    tokens = st.sampled_from(["[uv_break]", "[laugh_0]", "[speed_5]", "[", "]", "[x]", "\x00", "蘁", "\ud800"])
    return st.one_of(st.text(max_size=40), st.lists(st.one_of(tokens, st.text(max_size=4)), max_size=10).map("".join),
                     st.binary(max_size=40))


@given(text=_strings(), speaker=st.one_of(st.none(), _strings()), prompt=st.one_of(st.none(), _strings()))
@FUZZ
def test_fuzz_grpc_strings(served_tiny, text, speaker, prompt):
    values = dict(TEXT=text, MAX_NEW_TOKENS=2, SEED=0)
    if speaker is not None:
        values["SPEAKER"] = speaker
    if prompt is not None:
        values["PROMPT"] = prompt
    client = grpcclient.InferenceServerClient(served_tiny.grpc_url)
    try:
        audio = client.infer("chattts", contract_inputs(grpcclient, **values), client_timeout=60).as_numpy("AUDIO")
        assert audio.dtype == np.float32 and np.isfinite(audio).all() and audio.size > 0
        _seen("grpc ok")
    except InferenceServerException as e:
        assert e.status() == "StatusCode.INVALID_ARGUMENT", (e.status(), e.message(), values)
        _seen("grpc invalid")
    assert client.is_server_live()
    client.close()


def test_server_survived_the_fuzzing(served_tiny):
    """Runs after the fuzz tests in file order: the same server still serves normal requests."""
    print(f"\nfuzz outcomes: {SEEN}\nTriton frontend 500s seen: {sorted(FRONTEND_500S)}")
    if SEEN:  # the fuzz tests ran in this session: they must have hit both sides
        assert SEEN.get("grpc ok", 0) >= 5 and SEEN.get("grpc invalid", 0) >= 5, SEEN
        assert SEEN.get("http 200", 0) >= 1 and SEEN.get("http 400", 0) >= 10, SEEN
    client = grpcclient.InferenceServerClient(served_tiny.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    inputs = contract_inputs(grpcclient, TEXT="你好", MAX_NEW_TOKENS=4, SEED=1)
    audio = client.infer("chattts", inputs).as_numpy("AUDIO")
    assert np.isfinite(audio).all() and audio.size > 0
