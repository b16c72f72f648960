"""`SynthesisOptions` (client/contract.py): one options type for every client method; no Triton needed.

What reaches a request is read from recording transports (the clients' `transport` / `transports` seams), for the
sync and async clients, whole, batched and streamed, and the balancers over them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import numpy as np
import pytest

from chattts_triton import config as C
from client import (
    AsyncBalancedChatTTSClient,
    AsyncChatTTSClient,
    BalancedChatTTSClient,
    ChatTTSClient,
    ChatTTSInputError,
    SynthesisOptions,
    cli,
)
from client.contract import OPTION_FIELDS, OPTION_INPUTS, build_inputs, encode_input, input_datatype, takes_options

TEXT = "Hello there."


def value_for(field: str):
    """A valid value of every option, by its contract datatype (none equal to another field's)."""
    name = OPTION_INPUTS[field]
    datatype, dims = input_datatype(name), C.ENSEMBLE_INPUTS[name][1]
    if list(dims) == [-1]:
        return np.linspace(-0.5, 0.5, 37, dtype=np.float32)
    if datatype == "BYTES":
        return f"<{field}>"
    if datatype == "BOOL":
        return len(field) % 2 == 0
    if datatype.startswith("INT"):
        return 3 + len(field)
    return 0.25 + len(field) / 100


EVERY = {f: value_for(f) for f in OPTION_FIELDS}


# --- recording transports ------------------------------------------------------------------------------------------
class Recorder:
    def __init__(self):
        self.sent = []

    def infer(self, arrays, spoken_text=False):
        self.sent.append(dict(arrays))
        return np.full(8, 0.1, np.float32)

    def open_stream(self, model, chunk_timeout_s, spoken_text=False):
        return Session(self)

    def is_ready(self):
        return True

    def statistics(self, model):
        return {}

    def close(self):
        pass


class Session:
    def __init__(self, recorder):
        self.recorder = recorder

    def send(self, arrays):
        self.recorder.sent.append(dict(arrays))

    def receive(self):
        return np.full(4, 0.1, np.float32), True

    def close(self, cancel):
        pass


class AsyncRecorder(Recorder):
    async def infer(self, arrays, spoken_text=False):
        return Recorder.infer(self, arrays)

    def open_stream(self, model, chunk_timeout_s, spoken_text=False):
        return AsyncSession(self)

    async def is_ready(self):
        return True

    async def statistics(self, model):
        return {}

    async def close(self):
        pass


class AsyncSession(Session):
    async def send(self, arrays):
        Session.send(self, arrays)

    async def receive(self):
        return Session.receive(self)


def sync_client(balanced: bool):
    recorders = [Recorder(), Recorder()]
    if balanced:
        return BalancedChatTTSClient(["a:1", "b:1"], transports=recorders), recorders
    return ChatTTSClient("x:1", transport=recorders[0]), recorders[:1]


def async_client(balanced: bool):
    recorders = [AsyncRecorder(), AsyncRecorder()]
    if balanced:
        return AsyncBalancedChatTTSClient(["a:1", "b:1"], transports=recorders), recorders
    return AsyncChatTTSClient("x:1", transport=recorders[0]), recorders[:1]


def call(kind: str, method: str, *args, **kwargs):
    """`method` of a client of `kind` ('sync', 'async', each optionally 'balanced-'), run to its end: what it sent."""
    balanced = kind.startswith("balanced-")
    if kind.endswith("async"):
        client, recorders = async_client(balanced)

        async def run():
            async with client:
                if method == "stream":
                    return [c async for c in client.stream(*args, **kwargs)]
                return await getattr(client, method)(*args, **kwargs)

        asyncio.run(run())
    else:
        client, recorders = sync_client(balanced)
        with client:
            result = getattr(client, method)(*args, **kwargs)
            if method == "stream":
                list(result)
    return [arrays for r in recorders for arrays in r.sent]


KINDS = ["sync", "async", "balanced-sync", "balanced-async"]
METHODS = ["synthesize", "synthesize_batch", "stream"]


def texts_for(method: str):
    return [TEXT] if method == "synthesize_batch" else TEXT


def assert_carries(arrays, expected):
    assert set(arrays) == set(expected)
    for name, arr in expected.items():
        assert arrays[name].dtype == arr.dtype and np.array_equal(arrays[name], arr), name


# --- every option reaches the request ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("how", ["options", "keywords", "options+override"])
def test_every_option_reaches_the_request_tensors(kind, method, how):
    expected = {"TEXT": encode_input("TEXT", TEXT), **{OPTION_INPUTS[f]: encode_input(OPTION_INPUTS[f], v)
                                                       for f, v in EVERY.items()}}
    if how == "options":
        args, kwargs = (SynthesisOptions(**EVERY),), {}
    elif how == "keywords":
        args, kwargs = (), dict(EVERY)
    else:  # the override wins over the field, the other fields stay
        args, kwargs = (SynthesisOptions(**{**EVERY, "top_k": 999, "seed": None}),), {"top_k": EVERY["top_k"],
                                                                                        "seed": EVERY["seed"]}
    if method != "synthesize_batch":
        kwargs["split"] = False
    sent = call(kind, method, texts_for(method), *args, **kwargs)
    assert len(sent) == 1
    assert_carries(sent[0], expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
def test_no_options_sends_text_alone_and_none_resets_a_field(kind, method):
    assert [set(a) for a in call(kind, method, texts_for(method))] == [{"TEXT"}]
    opts = SynthesisOptions(seed=1, temperature=0.5)
    sent = call(kind, method, texts_for(method), opts, temperature=None)
    assert [set(a) for a in sent] == [{"TEXT", "SEED"}]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
def test_an_unknown_override_is_named(kind, method):
    with pytest.raises(TypeError, match=r"unknown option.*'topp'"):
        call(kind, method, texts_for(method), SynthesisOptions(seed=1), topp=0.5)
    with pytest.raises(TypeError, match=r"unknown option.*'sead'"):
        call(kind, method, texts_for(method), sead=1)


# --- one signature for all -----------------------------------------------------------------------------------------
OPTION_METHODS = [
    getattr(cls, name)
    for cls in (ChatTTSClient, AsyncChatTTSClient, BalancedChatTTSClient, AsyncBalancedChatTTSClient)
    for name in METHODS
]


@pytest.mark.parametrize("method", OPTION_METHODS, ids=lambda m: m.__qualname__)
def test_methods_name_no_option_field_so_a_new_field_needs_no_signature_change(method):
    code = method.__code__
    declared = set(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
    assert "options" in declared and not declared & set(OPTION_FIELDS)
    assert code.co_flags & inspect.CO_VARKEYWORDS  # **overrides
    # what help() and IDEs show is generated from the dataclass: every field, keyword-only, default None
    params = inspect.signature(method).parameters
    shown = [k for k, p in params.items() if k in OPTION_FIELDS]
    assert shown == list(OPTION_FIELDS)
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY and params[k].default is None for k in shown)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_takes_options_follows_the_dataclass_and_wants_overrides():
    def face(self, text, options=None, *, split=True, **overrides):
        return overrides

    params = inspect.signature(takes_options(face)).parameters
    assert list(params) == ["self", "text", "options", *OPTION_FIELDS, "split"]
    with pytest.raises(TypeError, match="overrides"):
        takes_options(lambda self, text, options=None: None)


# --- the type itself -----------------------------------------------------------------------------------------------
def test_one_field_per_optional_contract_input_none_by_default():
    assert set(OPTION_FIELDS) == {n.lower() for n, (_, _, required) in C.ENSEMBLE_INPUTS.items() if not required}
    assert SynthesisOptions().to_dict() == {}
    assert set(SynthesisOptions().to_inputs(TEXT)) == {"TEXT"}


def test_server_defaults_come_from_config():
    d = SynthesisOptions.server_defaults()
    assert list(d) == list(OPTION_FIELDS)
    code, refine = C.InferCodeParams(), C.RefineTextParams()
    assert (d["temperature"], d["top_p"], d["top_k"], d["repetition_penalty"], d["prompt"]) == (
        code.temperature, code.top_P, code.top_K, code.repetition_penalty, code.prompt)
    assert d["max_new_tokens"] == min(code.max_new_token, C.LIMITS.max_new_tokens)
    assert (d["refine_temperature"], d["refine_top_p"], d["refine_top_k"], d["refine_max_new_tokens"]) == (
        refine.temperature, refine.top_P, refine.top_K, refine.max_new_token)
    assert (d["refine_text"], d["use_decoder"], d["normalize_text"]) == (
        C.REFINE_TEXT_DEFAULT, C.USE_DECODER_DEFAULT, C.NORMALIZE_TEXT_DEFAULT)
    assert d["seed"] is d["speaker"] is d["voice"] is None


@pytest.mark.parametrize("field, value, match", [
    ("top_k", "20", "expected an int"), ("seed", True, "expected an int"), ("top_k", 2**40, "out of INT32 range"),
    ("temperature", float("nan"), "finite"), ("refine_text", 1, "expected a bool"),
    ("speaker", b"raw", "expected a str"),
    ("speaker_audio", [[0.1, 0.2], [0.3, 0.4]], "1-D"), ("speaker_audio", [], "non-empty"),
])  # fmt: skip
def test_a_bad_value_is_refused_when_the_options_are_made_naming_the_field(field, value, match):
    with pytest.raises(ChatTTSInputError, match=match) as e:
        SynthesisOptions(**{field: value})
    assert e.value.message.startswith(field) and e.value.status == "INVALID_ARGUMENT"
    with pytest.raises(ChatTTSInputError, match=match):
        SynthesisOptions().replace(**{field: value})
    with pytest.raises(ChatTTSInputError, match=match):  # the clients check before anything is sent
        ChatTTSClient("x:1", transport=Recorder()).synthesize(TEXT, **{field: value})


def test_unknown_names_are_named_everywhere():
    with pytest.raises(TypeError, match="topp"):
        SynthesisOptions(topp=0.5)
    with pytest.raises(TypeError, match=r"unknown option.*'topp'"):
        SynthesisOptions.of({"topp": 0.5})
    with pytest.raises(TypeError, match=r"unknown option.*'topp'"):
        SynthesisOptions().replace(topp=0.5)
    with pytest.raises(TypeError, match=r"unknown option.*'topp'"):
        build_inputs(TEXT, {"topp": 0.5})


def test_frozen_comparable_and_readable():
    audio = np.linspace(-0.1, 0.1, 240, dtype=np.float64)
    opts = SynthesisOptions(seed=7, voice="alloy", speaker_audio=audio)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 8
    assert opts.speaker_audio.dtype == np.float32 and opts.speaker_audio.shape == (240,)  # kept as it is sent
    assert opts == SynthesisOptions.of({"seed": 7, "voice": "alloy", "speaker_audio": audio.tolist()})
    assert opts != opts.replace(seed=8) and opts.replace(seed=None).seed is None
    assert SynthesisOptions.of(opts) is opts and SynthesisOptions.of(opts, seed=8).seed == 8 and opts.seed == 7
    assert repr(opts) == "SynthesisOptions(seed=7, speaker_audio=<float32[240]>, voice='alloy')"
    assert set(opts.to_dict()) == {"seed", "voice", "speaker_audio"}
    inputs = opts.to_inputs(TEXT)
    assert_carries(inputs, build_inputs(TEXT, opts.to_dict()))
    with pytest.raises(ValueError):  # requests share the checked arrays: nobody writes into them
        inputs["SEED"][0, 0] = 1
    for text in ("", "  "):
        with pytest.raises(ChatTTSInputError, match="empty"):
            opts.to_inputs(text)


def test_the_command_line_builds_synthesis_options_from_its_flags(tmp_path, monkeypatch):
    seen = []
    recorder = Recorder()
    real = ChatTTSClient.synthesize

    def synthesize(self, text, options=None, **kw):
        seen.append(options)
        return real(self, text, options, **kw)

    monkeypatch.setattr(ChatTTSClient, "synthesize", synthesize)
    monkeypatch.setattr(cli, "ChatTTSClient", lambda *a, **k: ChatTTSClient("x:1", transport=recorder))
    rc = cli.main([TEXT, "-o", str(tmp_path / "a.wav"), "-q", "--no-split", "--seed", "3", "--top-p", "0.5",
                   "--no-normalize-text", "--prompt", "[speed_3]"])
    assert rc == 0
    assert seen == [SynthesisOptions(seed=3, top_p=0.5, normalize_text=False, prompt="[speed_3]")]
    assert set(recorder.sent[0]) == {"TEXT", "SEED", "TOP_P", "NORMALIZE_TEXT", "PROMPT"}
    rc = cli.main([TEXT, "-o", str(tmp_path / "b.wav"), "-q", "--top-k", "0"])  # the server says no to 0, not the type
    assert rc == 0
    assert cli.main([TEXT, "-o", str(tmp_path / "c.wav"), "-q", "--top-k", str(2**40)]) == cli.EXIT_USAGE


def test_the_help_shows_the_server_defaults():
    text = cli.build_parser().format_help()
    assert f"(server default {C.InferCodeParams.temperature!r})" in text
