"""The voice store over HTTP (gateway/voices_http.py) without Triton: the gateway's app in process (Starlette's test
client) over an SQLite store, the model's speaker size from the tiny repository's manifest, and a recording encoded by
that repository's DVAE encoder in this process where the gateway asks chattts_preprocess (the real call:
tests/test_voices_http_e2e.py). Hostile bodies each get a 4xx naming the field and leave the store as it was; the
admin key's rule; the listing, one voice, delete. The same for the store's pronunciation lexicon
(gateway/lexicon_http.py): hostile entries and bodies, put/list/replace/delete seen by another view of the store, the
admin key's rule."""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest

from chattts_triton.config import BUILTIN_VOICE_SEEDS, FULL_ARCH
from chattts_triton.model import speaker as spk
from chattts_triton.runtime import voices as V
from gateway.app import Settings, create_app
from gateway.voices_http import VoicesAPI, is_loopback

HIDDEN = 64


def wav_bytes(seconds: float = 1.0, rate: int = 16000) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def png_bytes() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


@pytest.fixture
def client(tiny_repo, tmp_path, monkeypatch):
    """(test client, store) of a gateway on 127.0.0.1 with no admin key over an SQLite store."""
    from fastapi.testclient import TestClient

    from tests.test_gateway import FakeSynth

    async def encoded_here(self, wav, transcript):  # what chattts_preprocess's AUDIO_PROMPT gives, made in process
        return V.encode_reference(tiny_repo, wav)

    monkeypatch.setattr(VoicesAPI, "reference_sample", encoded_here)
    app = create_app(Settings(repo=tiny_repo, voice_store=f"sqlite://{tmp_path}/voices.db"), FakeSynth())
    with TestClient(app) as c:
        yield c, app.state.voices.store


def state(c, store):
    """What must not change: the listing and the store's generation."""
    return c.get("/v1/audio/voices").json(), store.generation()


BILLION_LAUGHS = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">'
                  '<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;">]><speak>&lol3;</speak>')
EXTERNAL = '<?xml version="1.0"?><!DOCTYPE s [<!ENTITY x SYSTEM "file:///etc/passwd">]><speak>&x;</speak>'
DTD = '<!DOCTYPE speak SYSTEM "http://example.invalid/speak.dtd"><speak>hello</speak>'
DEEP = "<speak>" + "<s>" * 5000 + "hi" + "</s>" * 5000 + "</speak>"


def form(name="clip", audio=(b"", "audio/wav"), transcript="hello there", **extra):
    """A multipart POST's (data, files): without a file, its text fields go as parts (multipart all the same)."""
    fields = {"name": name, **({"transcript": transcript} if transcript is not None else {}), **extra}
    if audio is None:
        return {}, {k: (None, v) for k, v in fields.items()}
    return fields, {"audio": ("clip.wav", audio[0], audio[1])}


HOSTILE = [
    # JSON: names
    ({"json": {"name": "../../etc/passwd", "seed": 1}}, 400, "name", "must be 1-64 letters"),
    ({"json": {"name": "a" * 65, "seed": 1}}, 400, "name", "must be 1-64"),
    ({"json": {"name": "bad\u202ename", "seed": 1}}, 400, "name", "must be 1-64"),
    ({"json": {"name": "nul\u0000", "seed": 1}}, 400, "name", "must be 1-64"),
    ({"json": {"name": "2222", "seed": 1}}, 400, "name", "not all digits"),
    ({"json": {"name": 5, "seed": 1}}, 400, "name", "must be a string"),
    ({"json": {"seed": 1}}, 400, "name", "required"),
    ({"json": {"name": "alloy", "seed": 1}}, 409, "name", "exists"),
    # JSON: sources and types
    ({"json": {"name": "x"}}, 400, "seed", "one of 'seed', 'speaker' or 'mix'"),
    ({"json": {"name": "x", "seed": 1, "mix": "alloy+nova"}}, 400, "mix", "one of"),
    ({"json": {"name": "x", "seed": -1}}, 400, "seed", "greater than or equal to 0"),
    ({"json": {"name": "x", "seed": "12"}}, 400, "seed", "valid integer"),
    ({"json": {"name": "x", "seed": 2**64}}, 400, "seed", "less than or equal to"),
    ({"json": {"name": "x", "seed": 1.5}}, 400, "seed", "valid integer"),
    ({"json": {"name": "x", "speaker": "not a speaker"}}, 400, "speaker", "not base16384"),
    ({"json": {"name": "x", "speaker": spk.sample_random_speaker(1, FULL_ARCH.gpt.hidden)}}, 400, "speaker", "768"),
    ({"json": {"name": "x", "speaker": ["list"]}}, 400, "speaker", "valid string"),
    ({"json": {"name": "x", "mix": "alloy*-1+nova"}}, 400, "mix", "not a number in (0, 1000]"),
    ({"json": {"name": "x", "mix": "alloy*nan+nova"}}, 400, "mix", "not a number"),
    ({"json": {"name": "x", "mix": "alloy*1e400+nova"}}, 400, "mix", "not a number"),
    ({"json": {"name": "x", "mix": "+".join(["alloy"] * 17)}}, 400, "mix", "more than 16"),
    ({"json": {"name": "x", "mix": "nope*0.5+alloy*0.5"}}, 400, "mix", "'nope' is not a voice"),
    ({"json": {"name": "x", "mix": "a+"}}, 400, "mix", "empty"),
    ({"json": {"name": "x", "seed": 1, "voice": "alloy"}}, 400, "voice", "not a field of a voice"),
    ({"json": {"name": "x", "seed": 1, "description": "d" * 201}}, 400, "description", "at most 200"),
    ({"json": {"name": "x", "seed": 1, "replace": "yes"}}, 400, "replace", "valid boolean"),
    # JSON: bodies
    ({"content": b"{", "headers": {"content-type": "application/json"}}, 400, None, "JSON object"),
    ({"content": b"[1, 2]", "headers": {"content-type": "application/json"}}, 400, None, "JSON object"),
    ({"content": b"[" * 30000, "headers": {"content-type": "application/json"}}, 400, None, "nested too deeply"),
    ({"content": json.dumps({"name": "x", "seed": 1, "description": "d" * (1 << 20)}).encode(),
      "headers": {"content-type": "application/json"}}, 400, None, "larger than 65536 bytes"),
    ({"content": BILLION_LAUGHS.encode(), "headers": {"content-type": "application/ssml+xml"}}, 415, "Content-Type",
     "application/json"),
    ({"content": b"name=x&seed=1", "headers": {"content-type": "application/x-www-form-urlencoded"}}, 415,
     "Content-Type", "multipart/form-data"),
    # multipart: the recording
    ({"form": form(audio=(b"\0" * (50 << 20), "audio/wav"))}, 400, "audio", "larger than"),
    ({"form": form(audio=(png_bytes(), "image/png"))}, 400, "audio", "'image/png', not audio"),
    ({"form": form(audio=(png_bytes(), "application/octet-stream"))}, 400, "audio", "not"),
    ({"form": form(audio=(b"this is not audio at all" * 100, "audio/wav"))}, 400, "audio", "not readable audio"),
    ({"form": form(audio=(b"", "audio/wav"))}, 400, "audio", "empty"),
    ({"form": form(audio=(wav_bytes(20.0), "audio/wav"))}, 400, "audio", "longer than 15 s"),
    ({"form": form(audio=None)}, 400, "audio", "required"),
    ({"form": form(audio=None, audio_as_text="x")}, 400, "audio_as_text", "not a field"),
    ({"form": ({}, {"name": (None, "clip"), "transcript": (None, "hi"), "audio": (None, "not a file")})}, 400, "audio",
     "file part"),
    # multipart: the other fields
    ({"form": form(audio=(wav_bytes(), "audio/wav"), transcript=None)}, 400, "transcript", "required"),
    ({"form": form(audio=(wav_bytes(), "audio/wav"), transcript="  ")}, 400, "transcript", "empty"),
    ({"form": form(audio=(wav_bytes(), "audio/wav"), transcript="x" * 2001)}, 400, "transcript", "more than 2000"),
    ({"form": form(audio=(wav_bytes(), "audio/wav"), transcript="[bogus_9] hi")}, 400, "transcript", "unknown token"),
    ({"form": form(name="../voices.json", audio=(wav_bytes(), "audio/wav"))}, 400, "name", "must be 1-64"),
    ({"form": form(name="alloy", audio=(wav_bytes(), "audio/wav"))}, 409, "name", "exists"),
    ({"form": form(audio=(wav_bytes(), "audio/wav"), seed="1")}, 400, "seed", "not a field"),
    ({"form": form(audio=(wav_bytes(), "audio/wav"), replace="maybe")}, 400, "replace", "true or false"),
]


def _send(c, case):
    if "form" in case:
        data, files = case["form"]
        return c.post("/v1/audio/voices", data=data, files=files)
    return c.post("/v1/audio/voices", **case)


@pytest.mark.parametrize("case, status, param, words", HOSTILE, ids=[f"{i}-{c[2]}" for i, c in enumerate(HOSTILE)])
def test_a_hostile_write_is_a_4xx_naming_the_field_and_changes_nothing(client, case, status, param, words):
    c, store = client
    before = state(c, store)
    r = _send(c, case)
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (status, param), error
    assert words in error["message"], error["message"]
    assert state(c, store) == before


@pytest.mark.parametrize("ssml", [BILLION_LAUGHS, EXTERNAL, DTD, DEEP], ids=["billion-laughs", "external-entity", "dtd",
                                                                             "deep-nesting"])
def test_hostile_ssml_is_a_400_naming_input_and_touches_no_voice(client, ssml):
    c, store = client
    before = state(c, store)
    r = c.post("/v1/audio/speech", json={"model": "chattts", "input": ssml, "voice": "alloy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.json()
    assert state(c, store) == before


@pytest.mark.parametrize("path", ["/v1/audio/voices/nope", "/v1/audio/voices/..%2F..%2Fvoices.json"])
def test_an_unknown_voice_is_a_404_on_get_and_delete(client, path):
    c, store = client
    before = state(c, store)
    for r in (c.get(path), c.delete(path)):
        assert r.status_code == 404, r.text
    assert c.get("/v1/audio/voices/nope").json()["error"]["code"] == "voice_not_found"
    assert state(c, store) == before


def test_seed_speaker_mix_and_recording_voices_are_stored_listed_and_deleted(client, tiny_repo):
    c, store = client
    r = c.post("/v1/audio/voices", json={"name": "narrator", "seed": 42, "description": "deep"})
    assert r.status_code == 201 and r.json() == {"id": "narrator", "name": "narrator", "object": "voice",
                                                 "source": "seed 42", "builtin": False, "description": "deep",
                                                 "seed": 42}
    assert store.get("narrator") == {"seed": 42, "description": "deep"}  # a seed alone: each reader makes its speaker
    speaker = spk.sample_random_speaker(7, HIDDEN)
    assert c.post("/v1/audio/voices", json={"name": "kept", "speaker": speaker}).status_code == 201
    mixed = c.post("/v1/audio/voices", json={"name": "blend", "mix": "narrator(7)+alloy(3)"}).json()
    registry = V.VoiceRegistry(tiny_repo, HIDDEN)  # stands for nothing here but the made mix's arithmetic
    expected = V.mix_voice("42*0.7+2222*0.3", registry.resolve, HIDDEN)
    assert mixed["speaker"] == expected.speaker and mixed["mix"] == "narrator*0.7+alloy*0.3"
    wav = wav_bytes(2.0)
    r = c.post("/v1/audio/voices", data={"name": "clip", "transcript": "hello there", "description": "a tone"},
               files={"audio": ("clip.wav", wav, "audio/wav")})
    assert r.status_code == 201, r.text
    decoded = V.decode_reference_audio(io.BytesIO(wav))
    assert r.json()["sample"] == V.encode_reference(tiny_repo, decoded) and r.json()["transcript"] == "hello there"
    listed = {v["id"]: v for v in c.get("/v1/audio/voices").json()["voices"]}
    assert set(listed) == set(BUILTIN_VOICE_SEEDS) | {"narrator", "kept", "blend", "clip"}
    assert listed["clip"]["source"] == "reference audio" and "sample" not in listed["clip"]
    assert c.get("/v1/audio/voices/kept").json()["speaker"] == speaker
    again = c.post("/v1/audio/voices", json={"name": "kept", "seed": 3, "replace": True})
    assert again.status_code == 201 and c.get("/v1/audio/voices/kept").json()["source"] == "seed 3"
    assert c.delete("/v1/audio/voices/clip").json() == {"id": "clip", "object": "voice", "deleted": True}
    assert "clip" not in {v["id"] for v in c.get("/v1/audio/voices").json()["voices"]}
    assert c.get("/v1/audio/voices/clip").status_code == 404


def _app(tmp_path, **settings):
    from fastapi.testclient import TestClient

    from tests.test_gateway import FakeSynth

    return TestClient(create_app(Settings(voice_store=f"sqlite://{tmp_path}/voices.db", **settings), FakeSynth()))


def test_writes_need_the_admin_key_where_one_is_set_and_reads_the_api_key(tmp_path):
    with _app(tmp_path, admin_key="admin-secret", api_keys=("user",)) as c:
        body = {"name": "narrator", "seed": 42}
        missing = c.post("/v1/audio/voices", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_admin_key"
        for key in ("user", "wrong"):  # an API key is no admin key
            r = c.post("/v1/audio/voices", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_admin_key"
            assert c.delete("/v1/audio/voices/alloy", headers={"Authorization": f"Bearer {key}"}).status_code == 403
        assert c.get("/v1/audio/voices").status_code == 401
        user = {"Authorization": "Bearer user"}
        assert "narrator" not in {v["id"] for v in c.get("/v1/audio/voices", headers=user).json()["voices"]}
        admin = {"Authorization": "Bearer admin-secret"}
        assert c.post("/v1/audio/voices", json=body, headers=admin).status_code == 201
        assert c.get("/v1/audio/voices/narrator", headers=user).json()["seed"] == 42
        assert c.delete("/v1/audio/voices/narrator", headers=admin).status_code == 200


def test_without_an_admin_key_writes_are_taken_on_loopback_only(tmp_path):
    with _app(tmp_path, host="0.0.0.0") as c:
        r = c.post("/v1/audio/voices", json={"name": "narrator", "seed": 42})
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
        assert c.delete("/v1/audio/voices/alloy").status_code == 403
        assert c.get("/v1/audio/voices").status_code == 200 and c.get("/v1/audio/voices/alloy").status_code == 200
    with _app(tmp_path, host="0.0.0.0", admin_key="k") as c:
        assert c.post("/v1/audio/voices", json={"name": "narrator", "seed": 42},
                      headers={"Authorization": "Bearer k"}).status_code == 201
    with _app(tmp_path, host="localhost") as c:
        assert c.post("/v1/audio/voices", json={"name": "other", "seed": 1}).status_code == 201
    assert is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("10.0.0.1")


def test_a_gateway_without_a_store_lists_the_builtins_and_refuses_writes(tmp_path):
    from fastapi.testclient import TestClient

    from tests.test_gateway import FakeSynth

    with TestClient(create_app(Settings(), FakeSynth())) as c:
        assert sorted(v["id"] for v in c.get("/v1/audio/voices").json()["voices"]) == sorted(BUILTIN_VOICE_SEEDS)
        assert c.get("/v1/audio/voices/nova").json()["seed"] == BUILTIN_VOICE_SEEDS["nova"]
        r = c.post("/v1/audio/voices", json={"name": "narrator", "seed": 42})
        assert r.status_code == 501 and "--voice-store" in r.json()["error"]["message"]


def test_the_command_line_refuses_a_store_url_that_names_no_store(capsys):
    from gateway.__main__ import build_parser, main

    a = build_parser().parse_args(["--voice-store", "redis://h:6379/0", "--admin-key", "k"])
    assert a.voice_store == "redis://h:6379/0" and a.admin_key == "k"
    with pytest.raises(SystemExit):
        main(["--voice-store", "mysql://h/db"])
    assert "--voice-store" in capsys.readouterr().err


# --- the pronunciation lexicon over HTTP (gateway/lexicon_http.py) -----------------------------------------------
def lexicon_state(c, store):
    """What a refused lexicon write must not change: its listing and the store's generation."""
    return c.get("/v1/audio/lexicon").json(), store.generation()


JSON = {"content-type": "application/json"}
LEXICON_HOSTILE = [
    # the word
    ({"word": "", "say": "x"}, 400, "word", "1-64 characters"),
    ({"word": "w" * 65, "say": "x"}, 400, "word", "1-64 characters"),
    ({"word": "two words", "say": "x"}, 400, "word", "holds ' '"),
    ({"word": "nul\u0000", "say": "x"}, 400, "word", "holds '\\x00'"),
    ({"word": "tab\tbed", "say": "x"}, 400, "word", "holds '\\t'"),
    ({"word": "evil\u202etxt", "say": "x"}, 400, "word", "U+202E"),
    ({"word": "zero\u200bwidth", "say": "x"}, 400, "word", "U+200B"),
    ({"word": "[uv_break]", "say": "x"}, 400, "word", "holds '['"),
    ({"word": 5, "say": "x"}, 400, "word", "must be a string, got int"),
    ({"word": ["a"], "say": "x"}, 400, "word", "must be a string, got list"),
    ({"word": None, "say": "x"}, 400, "word", "must be a string"),
    ({"say": "x"}, 400, "word", "required"),
    # what to say
    ({"word": "ok"}, 400, "say", "required"),
    ({"word": "ok", "say": ""}, 400, "say", "is empty"),
    ({"word": "ok", "say": "   "}, 400, "say", "only whitespace"),
    ({"word": "ok", "say": "s" * 257}, 400, "say", "more than the limit of 256"),
    ({"word": "ok", "say": "bell\u0007"}, 400, "say", "control character"),
    ({"word": "ok", "say": "[bogus_9] hi"}, 400, "say", "unknown token"),
    ({"word": "ok", "say": 5}, 400, "say", "must be a string, got int"),
    ({"word": "ok", "say": {"a": 1}}, 400, "say", "must be a string, got dict"),
    # the flags, the fields
    ({"word": "ok", "say": "x", "ignore_case": "yes"}, 400, "ignore_case", "true or false"),
    ({"word": "ok", "say": "x", "ignore_case": 1}, 400, "ignore_case", "true or false"),
    ({"word": "ok", "say": "x", "replace": "yes"}, 400, "replace", "true or false"),
    ({"word": "ok", "say": "x", "voice": "alloy"}, 400, "voice", "not a field of a lexicon entry"),
    # the store: an entry of that word, another ignoring case, full
    ({"word": "重庆", "say": "重亲"}, 409, "word", "has an entry '重庆'"),
    ({"word": "NGINX", "say": "n", "ignore_case": True}, 409, "word", "'nginx' ignores case"),
    ({"word": "brand-new", "say": "x", "full": True}, 409, "word", "the lexicon is full"),
]
LEXICON_BODIES = [
    ({"content": b"{"}, 400, None, "JSON object"),
    ({"content": b"[1, 2]"}, 400, None, "JSON object"),
    ({"content": b'"word"'}, 400, None, "JSON object, got str"),
    ({"content": b"[" * 10000}, 400, None, "nested too deeply"),
    ({"content": b'{"word": "\\ud800", "say": "x"}'}, 400, "word", "U+D800"),  # a lone surrogate: never stored
    ({"content": json.dumps({"word": "ok", "say": "s" * (1 << 20)}).encode()}, 400, None, "larger than 16384 bytes"),
    ({"content": BILLION_LAUGHS.encode(), "headers": {"content-type": "application/ssml+xml"}}, 415, "Content-Type",
     "application/json"),
    ({"content": b"word=ok&say=x", "headers": {"content-type": "application/x-www-form-urlencoded"}}, 415,
     "Content-Type", "application/json"),
    ({"content": b'{"word": "ok", "say": "x"}', "headers": {}}, 415, "Content-Type", "(none)"),
]


@pytest.fixture
def lexicon_client(client):
    """The gateway of `client` with two entries in its store's lexicon."""
    c, _ = client
    for entry in ({"word": "重庆", "say": "虫庆"}, {"word": "nginx", "say": "engine x", "ignore_case": True}):
        assert c.put("/v1/audio/lexicon", json=entry).status_code == 201
    return c, c.app.state.lexicon.store


@pytest.mark.parametrize("method", ["PUT", "POST"])
@pytest.mark.parametrize("body, status, param, words", LEXICON_HOSTILE,
                         ids=[f"{i}-{c[2]}" for i, c in enumerate(LEXICON_HOSTILE)])
def test_a_hostile_lexicon_write_is_a_4xx_naming_the_field_and_changes_nothing(lexicon_client, method, body, status,
                                                                               param, words):
    c, store = lexicon_client
    body = dict(body)
    if body.pop("full", False):
        store.max_docs = len(store.snapshot()[1])
    if method == "POST" or "重庆" not in body.values():  # PUT replaces an entry of that word: no refusal to test
        before = lexicon_state(c, store)
        r = c.request(method, "/v1/audio/lexicon", json=body)
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (status, param), error
        assert words in error["message"], error["message"]
        assert lexicon_state(c, store) == before


@pytest.mark.parametrize("case, status, param, words", LEXICON_BODIES, ids=[str(i) for i in range(len(LEXICON_BODIES))])
def test_a_hostile_lexicon_body_is_a_4xx_and_changes_nothing(lexicon_client, case, status, param, words):
    c, store = lexicon_client
    before = lexicon_state(c, store)
    r = c.put("/v1/audio/lexicon", content=case["content"], headers=case.get("headers", JSON))
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (status, param), error
    assert words in error["message"], error["message"]
    assert lexicon_state(c, store) == before


def test_lexicon_entries_are_put_listed_replaced_and_deleted(lexicon_client, tiny_repo):
    from chattts_triton.runtime import lexicon as L

    c, store = lexicon_client
    reader = L.LexiconRegistry(L.open_lexicon_store(store.url))  # another process's view of the same store
    assert reader.apply("重庆的NGINX") == "虫庆的engine x"
    r = c.post("/v1/audio/lexicon", json={"word": "TCP/IP", "say": "T C P I P"})
    assert r.status_code == 201 and r.json() == {"object": "lexicon.entry", "word": "TCP/IP", "say": "T C P I P",
                                                 "ignore_case": False}
    assert c.get("/v1/audio/lexicon").json() == {"object": "list", "entries": [
        {"object": "lexicon.entry", "word": "nginx", "say": "engine x", "ignore_case": True},
        {"object": "lexicon.entry", "word": "TCP/IP", "say": "T C P I P", "ignore_case": False},
        {"object": "lexicon.entry", "word": "重庆", "say": "虫庆", "ignore_case": False}]}
    assert c.get("/v1/audio/lexicon/TCP%2FIP").json()["say"] == "T C P I P"
    assert c.get("/v1/audio/lexicon/%E9%87%8D%E5%BA%86").json()["say"] == "虫庆"
    put = c.put("/v1/audio/lexicon", json={"word": "重庆", "say": " 虫亲 "})  # PUT replaces (200), the text trimmed
    assert put.status_code == 200 and put.json()["say"] == "虫亲"
    assert c.post("/v1/audio/lexicon", json={"word": "重庆", "say": "x", "replace": True}).status_code == 200
    assert c.put("/v1/audio/lexicon", json={"word": "重庆", "say": "y", "replace": False}).status_code == 409
    assert reader.apply("重庆 TCP/IP") == "x T C P I P"
    # the replacement's case rule may change, and an entry ignoring case may take another case's place once it is gone
    assert c.put("/v1/audio/lexicon", json={"word": "nginx", "say": "engine x"}).status_code == 200
    assert c.put("/v1/audio/lexicon", json={"word": "NGINX", "say": "N G", "ignore_case": True}).status_code == 201
    assert reader.apply("nginx Nginx") == "engine x N G"
    assert c.delete("/v1/audio/lexicon/TCP%2FIP").json() == {"object": "lexicon.entry", "word": "TCP/IP",
                                                             "deleted": True}
    for r in (c.delete("/v1/audio/lexicon/TCP%2FIP"), c.get("/v1/audio/lexicon/TCP%2FIP"),
              c.delete("/v1/audio/lexicon/..%2F..%2Flexicon.json")):
        assert r.status_code == 404 and r.json()["error"]["code"] == "lexicon_entry_not_found", r.text
    assert reader.apply("TCP/IP") == "TCP/IP"
    assert not (tiny_repo / "lexicon.json").exists()  # a shared store's lexicon: never the repository's file


def test_lexicon_writes_follow_the_voices_admin_key_rule(tmp_path):
    entry = {"word": "重庆", "say": "虫庆"}
    with _app(tmp_path, admin_key="admin-secret", api_keys=("user",)) as c:
        missing = c.put("/v1/audio/lexicon", json=entry)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_admin_key"
        for key in ("user", "wrong"):  # an API key is no admin key
            auth = {"Authorization": f"Bearer {key}"}
            for r in (c.put("/v1/audio/lexicon", json=entry, headers=auth),
                      c.post("/v1/audio/lexicon", json=entry, headers=auth),
                      c.delete("/v1/audio/lexicon/重庆", headers=auth)):
                assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_admin_key"
        assert c.get("/v1/audio/lexicon").status_code == 401  # reads need what speech needs
        user, admin = {"Authorization": "Bearer user"}, {"Authorization": "Bearer admin-secret"}
        assert c.get("/v1/audio/lexicon", headers=user).json()["entries"] == []
        assert c.put("/v1/audio/lexicon", json=entry, headers=admin).status_code == 201
        assert c.get("/v1/audio/lexicon/重庆", headers=user).json()["say"] == "虫庆"
        assert c.delete("/v1/audio/lexicon/重庆", headers=admin).status_code == 200
    with _app(tmp_path, host="0.0.0.0") as c:  # no admin key: writes on loopback only
        r = c.put("/v1/audio/lexicon", json=entry)
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
        assert c.delete("/v1/audio/lexicon/重庆").status_code == 403 and c.get("/v1/audio/lexicon").status_code == 200
    with _app(tmp_path, host="localhost") as c:
        assert c.post("/v1/audio/lexicon", json=entry).status_code == 201


def test_a_gateway_without_a_store_has_an_empty_lexicon_and_refuses_its_writes():
    from fastapi.testclient import TestClient

    from tests.test_gateway import FakeSynth

    with TestClient(create_app(Settings(), FakeSynth())) as c:
        assert c.get("/v1/audio/lexicon").json() == {"object": "list", "entries": []}
        r = c.put("/v1/audio/lexicon", json={"word": "重庆", "say": "虫庆"})
        assert r.status_code == 501 and "--voice-store" in r.json()["error"]["message"]


def test_a_gateway_on_a_repository_edits_its_lexicon_json(tmp_path, monkeypatch):
    """The default store: the repository's lexicon.json, as the lexicon CLI writes it."""
    from fastapi.testclient import TestClient

    from chattts_triton.runtime import lexicon as L
    from tests.test_gateway import FakeSynth

    monkeypatch.delenv("CHATTTS_VOICE_STORE", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "manifest.json").write_text("{}")  # no voice_store setting: the repository's files
    with TestClient(create_app(Settings(repo=repo), FakeSynth())) as c:
        assert c.put("/v1/audio/lexicon", json={"word": "AWS", "say": "A W S"}).status_code == 201
    assert L.read_lexicon(repo / "lexicon.json").apply("AWS") == "A W S"
