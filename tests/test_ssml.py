"""SSML (chattts_triton.model.ssml): the document → segments, say-as through the spoken-form normaliser, hostile
documents refused naming what is wrong; in chattts_preprocess (TEXT starting with <speak>: SPOKEN_TEXT, the prompt's
speed, the voice) and in the gateway (each segment its pieces, voice, speed and silence), then both against the real
tiny server."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from chattts_triton.config import BUILTIN_VOICE_SEEDS, LIMITS, SAMPLE_RATE, TINY_ARCH
from chattts_triton.model import speaker as spk
from chattts_triton.model import ssml
from chattts_triton.model.spoken import Phone, default
from chattts_triton.model.ssml import Segment, SSMLError
from chattts_triton.model.text import InputError
from tests.test_gateway_e2e import gateway  # noqa: F401  the gateway in front of served_tiny, as a fixture here

SPOKEN = default()


def speak(body: str, **attrs) -> str:
    extra = "".join(f' {k.replace("_", ":")}="{v}"' for k, v in attrs.items())
    return f'<speak version="1.1" xmlns="http://www.w3.org/2001/10/synthesis"{extra}>{body}</speak>'


def render(body: str, breaks: str = "silence", **attrs) -> ssml.Speech:
    return ssml.render(ssml.parse(speak(body, **attrs)), SPOKEN, breaks)


def texts(speech: ssml.Speech):
    return [s.text for s in speech.segments]


# --- what is SSML ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("<speak>Hi</speak>", True), ("  \n<speak version='1.1'>Hi</speak>", True), ('<?xml version="1.0"?><speak/>', True),
    ("<speakers>are loud", False), ("Hello <speak>", False), ("[uv_break]<speak>", False), ("", False),
    ("<!DOCTYPE speak><speak/>", True), ("<?xml-stylesheet?>", False), ("<p>Hi</p>", False),
])
def test_only_a_text_that_starts_with_speak_is_ssml(text, expected):
    assert ssml.is_ssml(text) is expected


# --- elements ----------------------------------------------------------------------------------------------
def test_plain_text_p_and_s_sub_and_whitespace():
    assert texts(render("Hello\n   world")) == ["Hello world"]
    # each p and s ends as a sentence: a full stop where it has none, "。" after Chinese
    assert texts(render("<p><s>First</s><s>Second!</s></p><p>第三段</p>Tail")) == ["First. Second! 第三段。 Tail"]
    assert texts(render("<s>Laugh [laugh_0]</s>")) == ["Laugh. [laugh_0]"]  # the mark goes before trailing tokens
    assert texts(render('I live in <sub alias="虫庆">重庆</sub>.')) == ["I live in 虫庆."]
    assert texts(render("Fish &amp; chips &#x4F60;&#22909;")) == ["Fish & chips 你好"]  # predefined and char refs


def test_breaks_are_silence_on_the_gateway_and_tokens_in_one_text():
    body = 'Hello <break time="1.5s"/>world<break strength="x-weak"/> again<break strength="none"/>.<break/>'
    speech = render(body)
    assert speech.segments == (Segment("Hello", pause_after_ms=1500),
                               Segment("world", pause_after_ms=ssml.BREAK_STRENGTH_MS["x-weak"]),
                               Segment("again.", pause_after_ms=ssml.BREAK_STRENGTH_MS[ssml.DEFAULT_BREAK]))
    # one text: up to TOKEN_BREAK_SPLIT_MS a short pause token, beyond a long one, none for a zero break
    assert texts(render(body, "tokens")) == ["Hello [lbreak] world [uv_break] again. [lbreak]"]
    assert texts(render('A<break time="500ms"/>B<break time="501ms"/>C<break time="0ms"/>D', "tokens")) == [
        "A [uv_break] B [lbreak] CD"]  # a zero break is no break: nothing between C and D
    # breaks before any text are the lead; adjacent ones add up
    speech = render('<break time="200ms"/><break time="300ms"/>Hi<break time="1s"/><break time="2s"/>')
    assert speech.lead_ms == 500 and speech.segments == (Segment("Hi", pause_after_ms=3000),)
    # both time and strength: time wins (SSML 1.1)
    assert render('A<break time="120ms" strength="x-strong"/>B').segments[0].pause_after_ms == 120


def test_voice_and_rate_cut_segments_and_punctuation_stays_with_its_text():
    speech = render('Narrator here. <voice name="nova">I am Nova, <prosody rate="slow">slowly</prosody>.</voice>'
                    '<voice name="2222"><prosody rate="150%">Fast <prosody '
                    'rate="+100%">faster</prosody></prosody></voice>')
    assert [(s.text, s.voice, s.rate) for s in speech.segments] == [
        ("Narrator here.", None, 1.0), ("I am Nova,", "nova", 1.0), ("slowly.", "nova", 0.75),
        ("Fast", "2222", 1.5), ("faster", "2222", 3.0)]  # nested rates multiply


@pytest.mark.parametrize("rate, factor", [("x-slow", 0.5), ("medium", 1.0), ("x-fast", 2.0), ("80%", 0.8),
                                          ("-20%", 0.8), ("+50%", 1.5), ("1.25", 1.25), ("25%", 0.25)])
def test_rate_values(rate, factor):
    assert render(f'<prosody rate="{rate}">Hi</prosody>').segments[0].rate == pytest.approx(factor)


def test_speed_token_table_and_rates_applied_to_a_prompt():
    assert [ssml.speed_token(ssml.speed_factor(n)) for n in range(10)] == [f"[speed_{n}]" for n in range(10)]
    assert ssml.with_rate("[speed_5]", 1.0) == "[speed_5]"
    assert ssml.with_rate("[speed_5][oral_2]", 2.0) == "[speed_8][oral_2]"  # the gateway's table: speed 2 -> 8
    assert ssml.with_rate("[oral_2]", 0.5) == "[speed_3][oral_2]"  # no speed token: from the default [speed_5]
    assert ssml.with_rate("[oral_1][speed_8]", 0.5) == "[oral_1][speed_5]"
    assert ssml.with_rate("[speed_9]", 4.0) == "[speed_9]" and ssml.with_rate("[speed_0]", 0.25) == "[speed_0]"


# --- say-as through the normaliser --------------------------------------------------------------------------
def say_as(kind: str, content: str, lang: str = "en-US", fmt: str = "") -> str:
    fmt = f' format="{fmt}"' if fmt else ""
    (segment,
     ) = render(f'<lang xml:lang="{lang}"><say-as interpret-as="{kind}"{fmt}>{content}</say-as></lang>').segments
    return segment.text


def test_say_as_reads_as_the_spoken_form_normaliser_reads_the_canonical_form():
    assert (say_as("cardinal", "1,234") == SPOKEN("1234", "en")
            and say_as("number", "-3.5", "zh-CN") == SPOKEN("-3.5", "zh"))
    # a four-digit cardinal is a count even where the normaliser would read a year
    assert say_as("cardinal", "2024") == SPOKEN("2024", "en") != SPOKEN("in 2024", "en").removeprefix("in ")
    assert say_as("ordinal", "21") == SPOKEN("21st", "en") and say_as("ordinal", "3", "zh") == SPOKEN("第3", "zh")
    assert say_as("date", "2024-03-05", "zh") == SPOKEN("2024年3月5日", "zh")
    assert say_as("date", "3/5/2024", fmt="mdy") == SPOKEN("March 5, 2024", "en")
    assert say_as("date", "5.3.2024", fmt="dmy") == say_as("date", "2024-03-05")
    assert (say_as("date", "Mar 2024", fmt="my") == f"March {SPOKEN.year(2024)}"
            and say_as("date", "1999") == SPOKEN.year(1999))
    assert say_as("time", "14:30", "zh") == SPOKEN("14:30", "zh")
    assert say_as("time", "2:30 p.m.", fmt="hms12") == SPOKEN("2:30 pm", "en")
    assert say_as("time", "2:30pm", "zh") == SPOKEN("下午2:30", "zh")
    # a phone number whatever its shape: as the normaliser reads one it recognises
    assert say_as("telephone", "13812345678", "zh") == SPOKEN.telephone(Phone(False, "", ("13812345678",)), "zh")
    assert SPOKEN("电话13812345678", "zh") == "电话" + say_as("telephone", "13812345678", "zh")
    assert say_as("telephone", "+1 (555) 123-4567") == SPOKEN.telephone(Phone(True, "1", ("555", "123", "4567")), "en")
    assert say_as("telephone", "12") == "one two"  # too short for the normaliser's rule: read digit by digit still


def test_say_as_characters_and_digits():
    assert say_as("characters", "AWS") == "A W S" and say_as("spell-out", "ab1") == "A B one"
    assert say_as("characters", "重庆2", "zh") == "重庆二" and say_as("characters", "A股", "zh") == "A 股"
    assert say_as("digits", "2024") == "two zero two four" and say_as("digits", "1 0-1", "zh") == "一零一"


def test_say_as_language_is_the_innermost_xml_lang_else_the_enclosing_sentences():
    body = ('<s>The code is <say-as interpret-as="digits">12</say-as></s><s>号码是<say-as '
            'interpret-as="digits">12</say-as></s>'
            '<s xml:lang="zh-CN">Code <say-as interpret-as="digits">12</say-as></s>')
    assert texts(render(body)) == ["The code is one two. 号码是一二。 Code 一二。"]


# --- what is refused ---------------------------------------------------------------------------------------
BILLION_LAUGHS = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
                  + "".join(f'<!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">'
                            for i in range(1, 10))
                  + ']><speak>&lol9;</speak>')
HOSTILE = [
    (BILLION_LAUGHS, "document type declaration"),
    ('<!DOCTYPE speak [<!ENTITY xxe SYSTEM "file:///etc/passwd">]><speak>&xxe;</speak>', "document type declaration"),
    ('<!DOCTYPE speak SYSTEM "http://127.0.0.1:1/ssml.dtd"><speak>hi</speak>', "document type declaration"),
    ('<!DOCTYPE speak [<!ENTITY % p SYSTEM "http://127.0.0.1:1/x">%p;]><speak>hi</speak>', "document type declaration"),
    ("<speak>" + "<s>" * 40 + "deep" + "</s>" * 40 + "</speak>", "deeper than 32"),
    ("<speak>" + "<prosody>" * 5000 + "x" + "</prosody>" * 5000 + "</speak>", "deeper than 32"),
    ("<speak><emphasis>hi</emphasis></speak>", "<emphasis> is not supported; supported: break, lang, p, prosody"),
    ("<speak><audio src='http://127.0.0.1:1/a.wav'/></speak>", "<audio> is not supported"),
    ('<speak><prosody pitch="high">hi</prosody></speak>',
     "<prosody> attribute 'pitch' is not supported; supported: rate"),
    ('<speak><break time="1s" foo="1"/></speak>', "<break> attribute 'foo'"),
    ('<speak xmlns:m="urn:x"><m:express-as>hi</m:express-as></speak>', "<express-as> of namespace 'urn:x'"),
    ('<speak xmlns:m="urn:x" m:style="x">hi</speak>', "attribute '{urn:x}style'"),
    ('<speak><break time="5"/></speak>', "<break time='5'>: give a duration like '500ms'"),
    ('<speak><break time="-1s"/></speak>', "<break time='-1s'>"),
    ('<speak><break time="11s"/></speak>', "longer than 10 s"),
    ('<speak><break time="abc"/></speak>', "<break time='abc'>"),
    ('<speak><break strength="huge"/></speak>', "<break strength='huge'>: use one of none, x-weak"),
    ("<speak>" + '<break time="10s"/>' * 7 + "</speak>", "more than 60 s of silence"),
    ("<speak><break>text</break></speak>", "<break> must be empty"),
    ('<speak><prosody rate="10">hi</prosody></speak>', "within 0.25-4 times"),
    ('<speak><prosody rate="fastest">hi</prosody></speak>', "<prosody rate='fastest'>"),
    ('<speak><voice name="a b">hi</voice></speak>', "<voice name='a b'>"),
    ("<speak><voice>hi</voice></speak>", "<voice> needs the attribute 'name'"),
    ("<speak><sub>重庆</sub></speak>", "<sub> needs the attribute 'alias'"),
    ('<speak><sub alias="x"><s>y</s></sub></speak>', "<sub> may not contain elements, found <s>"),
    ('<speak><lang xml:lang="fr-FR">Bonjour</lang></speak>', "ChatTTS speaks Chinese and English"),
    ('<speak><say-as interpret-as="currency">$5</say-as></speak>', "interpret-as='currency'> is not supported"),
    ('<speak><say-as interpret-as="cardinal">12a</say-as></speak>', "'12a' is not a number"),
    ('<speak><say-as interpret-as="cardinal">1234567890123456</say-as></speak>', "is not a number"),
    ('<speak><say-as interpret-as="ordinal">0</say-as></speak>', "not a positive whole number"),
    ('<speak><say-as interpret-as="digits">12x</say-as></speak>', "is not digits"),
    ('<speak><say-as interpret-as="date">2023-02-29</say-as></speak>', "is no date"),
    ('<speak><say-as interpret-as="date">3/5</say-as></speak>', "needs a format"),
    ('<speak><say-as interpret-as="date" format="xyz">3/5</say-as></speak>', "format='xyz'"),
    ('<speak><say-as interpret-as="time">25:00</say-as></speak>', "no time of day"),
    ('<speak><say-as interpret-as="time" format="hms12">14:00</say-as></speak>', "needs am or pm"),
    ('<speak><say-as interpret-as="telephone">call me</say-as></speak>', "not a phone number"),
    ('<speak><say-as interpret-as="cardinal" format="x">1</say-as></speak>', "takes no format"),
    ('<speak><say-as interpret-as="digits"></say-as></speak>', "is empty"),
    ("<speak>Fish &nbsp; chips</speak>", "not well-formed XML: undefined entity"),
    ("<speak><s>unclosed</speak>", "not well-formed XML: mismatched tag"),
    ("<speak>a</speak><speak>b</speak>", "not well-formed XML: junk after document element"),
    ("<speak><speak>inner</speak></speak>", "<speak> may only be the root element"),
    ("<speak>&#0;</speak>", "not well-formed XML"),
]


@pytest.mark.parametrize("document, words", HOSTILE)
def test_hostile_and_unsupported_documents_are_refused_naming_what_is_wrong(document, words):
    t0 = time.perf_counter()
    with pytest.raises(SSMLError) as e:
        ssml.parse(document)
    assert words in str(e.value) and time.perf_counter() - t0 < 0.5
    assert isinstance(e.value, InputError)  # a 400 / INVALID_ARGUMENT, never a server error


def test_the_root_must_be_speak():
    with pytest.raises(SSMLError, match="root element must be <speak>, got <p>"):
        ssml.parse("<p>hi</p>")


def test_one_text_takes_one_voice_and_one_rate():
    assert ssml.single(render('<voice name="nova">Hi <break/> there</voice>', "tokens")) == Segment(
        "Hi [lbreak] there", "nova")
    with pytest.raises(SSMLError, match="switches voice .the request’s to nova."):
        ssml.single(render('Hi <voice name="nova">there</voice>', "tokens"))
    with pytest.raises(SSMLError, match=r"switches <prosody rate> \(1 to 0.75 times\)"):
        ssml.single(render('Hi <prosody rate="slow">there</prosody>', "tokens"))
    with pytest.raises(SSMLError, match="nothing to speak"):
        ssml.single(render(" <s> </s> ", "tokens"))
    # a pause alone is a text of control tokens, as TEXT="[lbreak]" is (normalisation then refuses it)
    assert ssml.single(render('<break time="1s"/>', "tokens")) == Segment("[lbreak]")


# --- chattts_preprocess: TEXT that starts with <speak> -------------------------------------------------------
@pytest.fixture(scope="module")
def pre(tiny_assets, tmp_path_factory):
    from chattts_triton.runtime.preprocess import PreprocessService

    version = tmp_path_factory.mktemp("ssml-repo") / "chattts_preprocess" / "1"
    version.mkdir(parents=True)
    (version / "tokenizer").symlink_to(Path(tiny_assets) / "tokenizer", target_is_directory=True)
    service = PreprocessService(version, TINY_ARCH, torch.device("cpu"), "torchscript")
    yield service
    service.close()


def b(s: str) -> np.ndarray:
    return np.array([[s.encode()]], dtype=object)


def spoken_text(out) -> str:
    return out["SPOKEN_TEXT"][0, 0].decode("utf-8")


def test_preprocess_reads_ssml_into_spoken_text_and_the_prompt(pre):
    out = pre.prepare({"TEXT": b(speak('<prosody rate="x-fast">我住在<sub alias="虫庆">重庆</sub>，电话'
                                       '<say-as interpret-as="telephone">13812345678</say-as><break '
                                       'time="2s"/>好的</prosody>'))})
    expected = pre.normalize("我住在虫庆，电话" + say_as("telephone", "13812345678", "zh") + " [lbreak] 好的")
    assert spoken_text(out) == expected
    # the rate is the prompt's speed: the same tokens as the plain text with PROMPT [speed_8]
    plain = pre.prepare({"TEXT": b(expected), "PROMPT": b("[speed_8]"), "NORMALIZE_TEXT": np.array([[False]])})
    assert out["TEXT_IDS"].tolist() == plain["TEXT_IDS"].tolist()
    # relative to the request's PROMPT speed
    slow = pre.prepare({"TEXT": b(speak('<prosody rate="50%">Hi</prosody>')), "PROMPT": b("[speed_3][oral_1]")})
    assert slow["TEXT_IDS"].tolist() == pre.prepare({"TEXT": b("Hi"),
                                                     "PROMPT": b("[speed_1][oral_1]")})["TEXT_IDS"].tolist()


def test_preprocess_takes_the_ssml_voice_as_voice(pre):
    by_ssml = pre.prepare({"TEXT": b(speak('<voice name="echo">你好</voice>'))})
    assert np.array_equal(by_ssml["SPK_EMB"], pre.prepare({"TEXT": b("你好"), "VOICE": b("echo")})["SPK_EMB"])
    assert np.array_equal(by_ssml["SPK_EMB"][0], spk.speaker_embedding(
        spk.sample_random_speaker(BUILTIN_VOICE_SEEDS["echo"], TINY_ARCH.gpt.hidden), TINY_ARCH.gpt.hidden).numpy())
    same = pre.prepare({"TEXT": b(speak('<voice name="echo">你好</voice>')), "VOICE": b("echo")})
    assert np.array_equal(same["SPK_EMB"], by_ssml["SPK_EMB"])
    with pytest.raises(InputError, match=r"^TEXT: SSML <voice name='echo'> is not VOICE 'nova'"):
        pre.prepare({"TEXT": b(speak('<voice name="echo">你好</voice>')), "VOICE": b("nova")})
    with pytest.raises(InputError, match=r"^TEXT: SSML switches voice"):
        pre.prepare({"TEXT": b(speak('你好<voice name="echo">再见</voice>'))})
    with pytest.raises(InputError, match="VOICE 'nobody' is not a voice of this server"):
        pre.prepare({"TEXT": b(speak('<voice name="nobody">你好</voice>'))})


@pytest.mark.parametrize("document, words", HOSTILE[:3] + HOSTILE[6:7] + HOSTILE[12:13])
def test_preprocess_refuses_hostile_ssml_naming_text(pre, document, words):
    with pytest.raises(InputError) as e:
        pre.prepare({"TEXT": b(document)})
    assert str(e.value).startswith("TEXT: SSML") and words in str(e.value)


def test_preprocess_limits_the_document_and_what_it_reads_to_the_text_limit(pre):
    with pytest.raises(InputError, match=f"more than the limit of {LIMITS.max_text_chars}"):
        pre.prepare({"TEXT": b(speak("x" * LIMITS.max_text_chars))})
    long = speak('<say-as interpret-as="characters">' + "A" * 1000 + "</say-as>")  # 1999 letters and spaces: fits
    assert spoken_text(pre.prepare({"TEXT": b(long)})).count("A") == 1000
    with pytest.raises(InputError, match=r"TEXT \(as its SSML reads\) has 2399 characters"):
        pre.prepare({"TEXT": b(speak('<say-as interpret-as="characters">' + "A" * 1200 + "</say-as>"))})


def test_without_normalisation_ssml_is_still_read_and_say_as_still_spoken(pre):
    out = pre.prepare({"TEXT": b(speak('Pin <say-as interpret-as="digits">42</say-as> at 10:30')),
                       "NORMALIZE_TEXT": np.array([[False]])})
    assert spoken_text(out) == "Pin four two at 10:30"


# --- the gateway (a stand-in synthesizer; the real server below) ------------------------------------------
def gateway_job(**fields):
    from gateway.app import Settings
    from tests.test_gateway import OK, Served

    with Served(Settings(stream_default=False)) as s:
        status, headers, body = s.request("/v1/audio/speech", {**OK, **fields})
        return status, headers, body, (s.synth.jobs[-1] if s.synth.jobs else None)


def test_gateway_sends_each_segment_in_its_voice_and_speed_with_its_silence():
    long = "This sentence is long enough to be a piece of its own here. " * 2
    document = speak(f'<break time="300ms"/>{long}<break time="1s"/><voice name="nova">Short.</voice>'
                     f'<prosody rate="x-slow">Slow <say-as interpret-as="cardinal">12</say-as>.</prosody>'
                     f'<break time="250ms"/>')
    status, headers, _, job = gateway_job(input=document, seed=3, speed=2.0)
    assert status == 200 and headers["X-ChatTTS-Pieces"] == str(len(job.pieces))
    from gateway.synth import split_text

    first = split_text(long.strip())
    assert len(first) == 2 and job.pieces == first + ["Short.", "Slow twelve."]
    options = [job.piece_options(i) for i in range(len(job.pieces))]
    assert [o.get("voice") for o in options] == ["alloy", "alloy", "nova", "alloy"]
    assert [o["prompt"] for o in options] == ["[speed_8]", "[speed_8]", "[speed_8]", "[speed_5]"]  # 2 × 0.5 = 1
    assert [o["seed"] for o in options] == [3, 4, 5, 6]
    assert job.gaps_ms == [300, None, 1000, None, 250]


def test_gateway_timings_carry_the_silence_of_breaks():
    from gateway.app import Settings
    from tests.test_gateway import OK, Served, spoken

    document = speak('<break time="100ms"/>First part here.<break time="1s"/>Second part here.')
    with Served(Settings()) as s:
        s.synth.pause = np.zeros(4800, np.float32)
        status, _, body = s.request("/v1/audio/speech/captioned", {**OK, "input": document, "response_format": "pcm"})
        sse_status, _, sse = s.request("/v1/audio/speech", {**OK, "input": document, "response_format": "pcm",
                                                             "stream_format": "sse"})
    piece, lead, gap = SAMPLE_RATE // 2, SAMPLE_RATE // 10, SAMPLE_RATE  # the stand-in's 0.5 s a piece
    reply = json.loads(body)
    assert status == 200 and reply["samples"] == lead + piece + gap + piece
    assert [(g["text"], g["start_sample"], g["end_sample"], g["spoken_text"]) for g in reply["segments"]] == [
        ("First part here.", lead, lead + piece, spoken("First part here.")),
        ("Second part here.", lead + piece + gap, lead + 2 * piece + gap, spoken("Second part here."))]
    audio = np.frombuffer(base64.b64decode(reply["audio"]), "<i2")
    assert (not audio[:lead].any() and not audio[lead + piece:lead + piece + gap].any()
            and audio[lead:lead + piece].any())
    events = [json.loads(x[6:]) for x in sse.decode().split("\n\n") if x.startswith("data: ")]
    streamed = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert sse_status == 200 and streamed == base64.b64decode(reply["audio"])
    assert [(e["start_sample"], e["end_sample"]) for e in events if e["type"] == "speech.segment"] == [
        (g["start_sample"], g["end_sample"]) for g in reply["segments"]]


@pytest.mark.parametrize("document, words", HOSTILE)
def test_gateway_answers_hostile_ssml_with_a_400_naming_input(document, words):
    from gateway import api

    with pytest.raises(api.APIError) as e:
        api.parse(json.dumps({"model": "chattts", "voice": "alloy", "input": document}).encode())
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["param"] == "input"
    if len(document) > api.MAX_INPUT_CHARS:  # refused before it is parsed
        assert err["code"] == "string_above_max_length"
    else:
        assert err["code"] == "invalid_ssml" and words in err["message"]


def test_gateway_refuses_huge_and_empty_ssml_and_a_split_false_part_over_the_limit():
    status, _, body, _ = gateway_job(input=speak("x" * 4096))
    assert status == 400 and "limit of 4096" in json.loads(body)["error"]["message"]
    status, _, body, job = gateway_job(input=speak('<break time="1s"/>'))
    assert status == 400 and json.loads(body)["error"]["message"] == "'input' has nothing to speak" and job is None
    status, _, body, _ = gateway_job(input=speak("y " * 1100), split=False)
    assert (status == 400
            and "each part of the SSML 'input' must be at most 2000" in json.loads(body)["error"]["message"])
    status, _, body, job = gateway_job(input=speak("Hello <break/> there"), split=False)
    assert status == 200 and job.pieces == ["Hello", "there"]


# --- against the real tiny server ---------------------------------------------------------------------------
def served_spoken(server, **values):
    import tritonclient.grpc as grpcclient

    from client.contract import build_inputs, to_infer_inputs

    c = grpcclient.InferenceServerClient(server.grpc_url)
    text = values.pop("text")
    result = c.infer("chattts", to_infer_inputs(grpcclient, build_inputs(text, values)),
                     outputs=[grpcclient.InferRequestedOutput("SPOKEN_TEXT"), grpcclient.InferRequestedOutput("AUDIO")])
    return result.as_numpy("SPOKEN_TEXT")[0, 0].decode("utf-8"), result.as_numpy("AUDIO")[0]


@pytest.mark.e2e
def test_ssml_over_grpc_and_the_stream_model(served_tiny):
    from client import ChatTTSClient, ChatTTSError

    fixed = dict(seed=4, max_new_tokens=12, min_new_tokens=12)
    document = speak('<voice name="onyx">我住在<sub alias="虫庆">重庆</sub><break time="200ms"/>'
                     '<say-as interpret-as="ordinal">3</say-as>楼</voice>')
    said, audio = served_spoken(served_tiny, text=document, **fixed)
    assert said == "我住在虫庆 [uv_break] 第三楼"
    # the same audio as the plain text it reads, in the voice it names
    plain, same = served_spoken(served_tiny, text=said, voice="onyx", normalize_text=False, **fixed)
    assert plain == said and np.array_equal(audio, same)
    with ChatTTSClient(served_tiny.grpc_url) as c:
        told = []
        chunks = list(c.stream(document, split=False, voice_from_first=False, on_spoken_text=told.append, **fixed))
        assert told == [said] and np.concatenate(chunks).size == audio.size
        for text, words in [(BILLION_LAUGHS, "document type declaration"),
                            (HOSTILE[6][0], "<emphasis> is not supported"),
                            (speak('你好<voice name="echo">再见</voice>'), "switches voice")]:
            with pytest.raises(ChatTTSError) as e:
                c.synthesize(text, split=False, **fixed)
            assert e.value.status == "INVALID_ARGUMENT" and "TEXT: SSML" in e.value.message and words in e.value.message


@pytest.mark.e2e
def test_ssml_through_the_gateway_speaks_each_segment_as_its_own_grpc_call(served_tiny, gateway):  # noqa: F811  the fixture imported above
    from client import ChatTTSClient
    from gateway.audio import decode, to_int16
    from tests.test_gateway_e2e import FIXED, post

    url = gateway
    document = speak('Hello there.<break time="500ms"/><voice name="nova"><prosody rate="fast">'
                     '我住在<sub alias="虫庆">重庆</sub>。</prosody></voice>')
    status, _, data = post(url, "/v1/audio/speech/captioned", {"model": "chattts", "voice": "alloy", "input": document,
                                                              "seed": 9, "response_format": "wav", **FIXED})
    reply = json.loads(data)
    assert status == 200, data
    assert [(g["text"], g["spoken_text"]) for g in reply["segments"]] == [("Hello there.", "Hello there."),
                                                                         ("我住在虫庆。", "我住在虫庆。")]
    first, second = reply["segments"]
    assert second["start_sample"] - first["end_sample"] == SAMPLE_RATE // 2  # the break's silence, not the pause
    audio = decode(base64.b64decode(reply["audio"]), "wav")
    with ChatTTSClient(served_tiny.grpc_url) as c:
        a = c.synthesize("Hello there.", voice="alloy", seed=9, prompt="[speed_5]", split=False, **FIXED)
        b_ = c.synthesize("我住在虫庆。", voice="nova", seed=10, prompt="[speed_6]", split=False, **FIXED)
    got = np.round(audio * 32768).astype(np.int16)
    # each piece: the same tokens as its own call; pieces batched together may round in the last bits: ≤ 1 LSB
    for segment, expected in ((first, a), (second, b_)):
        spoken_piece = got[segment["start_sample"]:segment["end_sample"]]
        assert np.abs(spoken_piece.astype(np.int32) - to_int16(expected)).max() <= 1
    assert not got[first["end_sample"]:second["start_sample"]].any() and got.size == second["end_sample"]
    status, _, data = post(url, "/v1/audio/speech", {"model": "chattts", "voice": "alloy", "input": BILLION_LAUGHS})
    assert status == 400 and json.loads(data)["error"]["param"] == "input"

