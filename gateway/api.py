"""The OpenAI speech API's request body, its errors, and how its fields become `chattts` contract inputs.

`POST /v1/audio/speech` takes OpenAI's body (`model`, `input`, `voice`, `response_format`, `speed`,
`stream_format`, `instructions`) and, as optional extras, the ChatTTS sampling inputs under their contract
names in lower case (`seed`, `temperature`, `top_p`, ...), and the output's `sample_rate`. Fields of newer API
versions that this gateway does not know are ignored, as OpenAI's own clients send them. An `input` that starts with
`<speak` is SSML (chattts_triton.model.ssml, docs/ssml.md): checked here, its segments are the request's pieces. With
`input_format: "dialogue"` the input is a script of `LABEL: text` lines, each spoken in the voice `voices` gives its
label (`parse_dialogue`), `line_pause_ms` apart; never guessed from a text with colons.
`POST /v1/audio/speech/captioned` takes the same body and `subtitle_format`.

`voice` is a voice name or seed number, `{"id": ...}`, a mix (`"2222*0.7+nova*0.3"`, resolved by the server:
chattts_triton/model/mix.py), or a voice of this request only, `{"audio": base64, "transcript": ...}`: reference audio
decoded here (`decode_reference_audio`, as the voices CLI decodes a file) and sent as SPEAKER_AUDIO / SPEAKER_TEXT,
which the server encodes with its DVAE encoder as it encoded a stored voice's recording (docs/gateway.md#voices).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import math
import re
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    ValidationInfo,
    create_model,
    model_validator,
)

from chattts_triton.config import ENSEMBLE, LIMITS, SAMPLE_RATE, InferCodeParams
from chattts_triton.model import mix as voice_mix
from chattts_triton.model import ssml
from chattts_triton.model.ssml import SPEED_TOKEN, SPEED_UPPER_BOUNDS, speed_token
from client.contract import OPTION_FIELDS, OPTION_INPUTS, input_datatype

from .audio import FORMATS, check
from .synth import Job, speakable, split_text

# `model` values taken: this server's model, and OpenAI's speech model names (clients hard-code them)
MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
MODELS = (ENSEMBLE,) + MODEL_ALIASES
MAX_INPUT_CHARS = 4096  # OpenAI's limit of `input`; the gateway splits it into pieces the server takes

# OpenAI `speed` (0.25-4.0, 1.0 normal) -> ChatTTS [speed_N] (0-9, upstream's default 5): `speed_token`, the table
# SSML's prosody rate also goes through (chattts_triton.model.ssml). N grows with the logarithm of the speed:
# N = 5 + 2.5 log2(speed), rounded and held to 0-9 (0.25 -> 0, 0.5 -> 3, 1 -> 5, 2 -> 8, 4 -> 9; docs/gateway.md
# prints the table). ChatTTS has ten speeds, so nearby values share one.


class VoiceRef(BaseModel):
    """OpenAI's newer form of `voice`: {"id": "..."}."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str


# A voice of one request: reference audio (base64 of a file, or a data: URL) and what it says. The file may be at most
# MAX_VOICE_AUDIO_BYTES (15 s of 48 kHz stereo float WAV fits; a body with it may exceed the gateway's body limit by
# that much) and at most the reference-audio limit long once decoded.
MAX_VOICE_AUDIO_BYTES = 8 << 20
MAX_VOICE_AUDIO_BASE64 = 4 * ((MAX_VOICE_AUDIO_BYTES + 2) // 3) + 256  # + a data: URL's prefix
_DATA_URL = re.compile(r"^data:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)


class VoiceAudio(BaseModel):
    """`voice: {"audio": base64, "transcript": "..."}` (vLLM-Omni's `ref_audio` / `ref_text`): a voice taken from a
    recording for this request only, as a stored voice of reference audio is (the voices CLI's `add --audio`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    audio: str
    transcript: str = Field(max_length=LIMITS.max_text_chars)


def _voice_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "voice-name"
    if isinstance(value, VoiceAudio) or (isinstance(value, dict) and "audio" in value):
        return "voice-audio"
    if isinstance(value, (dict, VoiceRef)):
        return "voice-id"
    return None


Voice = Annotated[Annotated[str, Tag("voice-name")] | Annotated[VoiceRef, Tag("voice-id")]
                  | Annotated[VoiceAudio, Tag("voice-audio")],
                  Discriminator(_voice_kind, custom_error_type="voice_type",
                                custom_error_message="Input should be a valid string (a voice name or mix), "
                                                     "{\"id\": ...} "
                                                     "or {\"audio\": ..., \"transcript\": ...}")]


# The ChatTTS inputs a body takes: every field of `SynthesisOptions` under its name (the contract input in lower case),
# but the voice's, which `voice` gives (a name, a mix, or reference audio). Each is typed by its contract input, so a
# field added to SynthesisOptions is a body field with nothing written here; these bounds answer a 400 before the
# server is asked (beyond them the server's INVALID_ARGUMENT names the field), the REFINE_* sampling inputs checked as
# the code's are (runtime/inputs.py: refine_params).
VOICE_FIELDS = ("voice", "speaker", "speaker_audio", "speaker_text", "speaker_sample")
BODY_OPTIONS = tuple(f for f in OPTION_FIELDS if f not in VOICE_FIELDS)
BODY_BOUNDS: dict[str, dict[str, Any]] = {
    "seed": {"ge": 0, "le": 2**63 - 1},  # the seed schedule counts up from it
    "temperature": {"gt": 0, "le": 100},
    "top_p": {"gt": 0, "le": 1},
    "top_k": {"ge": 1, "le": 2**30},
    "repetition_penalty": {"gt": 0, "le": 100},
    "max_new_tokens": {"ge": 1, "le": LIMITS.max_new_tokens},
    "min_new_tokens": {"ge": 0, "le": LIMITS.max_new_tokens},
    "prompt": {"max_length": 256},
}


def _body_field(name: str) -> tuple[Any, Any]:
    """The body field of SynthesisOptions field `name`: optional, of its contract input's type (strict), bounded."""
    from tritonclient.utils import triton_to_np_dtype

    datatype = input_datatype(OPTION_INPUTS[name])
    if datatype.startswith(("INT", "UINT")):
        info = np.iinfo(triton_to_np_dtype(datatype))
        kind, bounds = int, {"ge": int(info.min), "le": int(info.max)}
    else:
        kind, bounds = {"BYTES": (str, {}), "BOOL": (bool, {}), "FP32": (float, {"allow_inf_nan": False})}[datatype]
    bounds.update(BODY_BOUNDS.get(name.removeprefix("refine_"), {}))
    return kind | None, Field(None, **bounds)


# strict: "1.5" is not a speed and 1 is not a string (wrong types get a 400 naming the field)
ChatTTSOptions = create_model(
    "ChatTTSOptions", __config__=ConfigDict(strict=True, extra="ignore"), __module__=__name__,
    __doc__="What a speech request and a realtime session (gateway.realtime) share: OpenAI's `speed`, the output "
            "rate (`sample_rate`, of the audio sent: one of audio.SAMPLE_RATES), and the ChatTTS inputs "
            "(`BODY_OPTIONS`; omitted: the server's default).",
    speed=(float, Field(1.0, ge=0.25, le=4.0)), sample_rate=(int, SAMPLE_RATE),
    **{name: _body_field(name) for name in BODY_OPTIONS},
)  # fmt: skip


# A dialogue (`input_format: "dialogue"`): `input` is a script of lines `LABEL: text`, `voices` maps each label to a
# voice; each line is spoken in its voice, the lines joined with `line_pause_ms` of silence (docs/gateway.md#dialogue).
MAX_DIALOGUE_LINES = 64
MAX_DIALOGUE_SPEAKERS = 16
MAX_LABEL_CHARS = 64
DIALOGUE_PAUSE_MS = 400  # between the lines of a dialogue: a turn's pause, longer than --pause-ms between pieces
MAX_LINE_PAUSE_MS = 5000
_DIALOGUE_LINE = re.compile(r"^\s*([^:：\s][^:：]*?)\s*[:：](.*)$")  # the label ends at the first colon (or ：)

ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm", "ulaw", "alaw", "wav_ulaw", "wav_alaw"]


class SpeechRequest(ChatTTSOptions):
    model: str
    input: str
    voice: Voice
    response_format: ResponseFormat = "mp3"
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None  # gpt-4o-mini-tts's style prompt: accepted, not used (ChatTTS takes none)
    # --- gateway switches
    stream: bool | None = None  # audio as it is made (default: the gateway's --stream-default; flac: whole)
    split: bool = True  # long input in pieces (sentences); false sends it as one piece (≤ 2000 characters)
    input_format: Literal["text", "dialogue"] = "text"  # dialogue: `input` is lines `LABEL: text`, voiced by `voices`
    voices: dict[str, str] | None = None  # a dialogue's speaker label -> voice (a name, seed number or mix)
    line_pause_ms: int = Field(DIALOGUE_PAUSE_MS, ge=0, le=MAX_LINE_PAUSE_MS)  # silence between a dialogue's lines
    # each later piece conditioned on the first piece's audio (upstream's spk_smp path), where it speaks in that voice
    condition_on_first_piece: bool = False
    _ssml: ssml.Document | None = PrivateAttr(None)  # `input` as SSML, when it is
    _dialogue: list[tuple[str, str]] | None = PrivateAttr(None)  # (voice, text) of each line of a dialogue
    _ref: bool = PrivateAttr(False)  # the voice came as vLLM-Omni's top-level `ref_audio` / `ref_text`

    @model_validator(mode="before")
    @classmethod
    def _ref_audio(cls, data: Any, info: ValidationInfo) -> Any:
        """vLLM-Omni's `ref_audio` / `ref_text` (top level) are the voice `{"audio", "transcript"}`, in place of the
        `voice` OpenAI's clients must send; with a voice of reference audio too they are refused."""
        if isinstance(data, dict) and ("ref_audio" in data or "ref_text" in data):
            data = dict(data)
            audio, text = data.pop("ref_audio", None), data.pop("ref_text", None)
            if isinstance(data.get("voice"), dict) and "audio" in data["voice"]:
                raise ValueError("give 'voice' with 'audio' or 'ref_audio', not both")
            if audio is None:
                raise ValueError("'ref_text' goes with 'ref_audio', the recording it transcribes")
            data["voice"] = {"audio": audio, **({"transcript": text} if text is not None else {})}
            if isinstance(info.context, dict):
                info.context["ref"] = True
        return data


class CaptionedRequest(SpeechRequest):
    """`POST /v1/audio/speech/captioned`: the speech body, answered whole as JSON with each piece's timings;
    `subtitle_format` adds them as subtitle text."""

    subtitle_format: Literal["srt", "vtt"] | None = None


assert set(ResponseFormat.__args__) == set(FORMATS)


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


REF_FIELDS = {"voice.audio": "ref_audio", "voice.transcript": "ref_text"}


def _as_ref(e: APIError) -> APIError:
    """An error about the voice audio named as the fields a vLLM-Omni client sent."""
    if e.param in REF_FIELDS:
        e.message = e.message.replace(f"'{e.param}'", f"'{REF_FIELDS[e.param]}'")
        e.param = REF_FIELDS[e.param]
    return e


def _describe(err: dict[str, Any]) -> tuple[str, str | None]:
    loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
    # a Union's branch name ("str", "VoiceRef") is no field of the body
    loc = [x for x in loc if x not in ("str", "VoiceRef", "function-after[...]", "voice-name", "voice-id",
                                       "voice-audio")]
    param = loc[0] if loc else None
    if "voice-audio" in err.get("loc", ()):  # the fields of a voice of reference audio are named in full
        param = ".".join(loc)
    if err.get("type") == "missing":
        return f"'{'.'.join(loc)}' is a required property", param
    if err.get("type") in ("json_invalid", "model_type"):
        return f"the body must be a JSON object ({err.get('msg')})", None
    got = err.get("input")
    shown = repr(got) if isinstance(got, (int, float, bool, type(None))) or (isinstance(got, str) and len(got) < 60) \
        else type(got).__name__
    return f"'{'.'.join(loc)}': {err.get('msg')}, got {shown}", param


def parse(body: bytes, model: type = SpeechRequest, max_body_bytes: int | None = None) -> SpeechRequest:
    """The request (a `model`), or APIError(400) naming the first field at fault. `max_body_bytes`: the body limit
    beside a voice's reference audio (a body with it may be larger by the audio's base64, up to
    MAX_VOICE_AUDIO_BASE64)."""
    context: dict[str, Any] = {}
    try:
        req = model.model_validate_json(body, context=context)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err.get("type") == "value_error" and "ref_audio" in str(err.get("msg")):
            raise invalid(f"{err['msg'].removeprefix('Value error, ')}", "ref_audio") from None
        message, param = _describe(err)
        error = invalid(message, param)
        raise (_as_ref(error) if context.get("ref") else error) from None
    req._ref = bool(context.get("ref"))
    try:
        return _checked(req, max_body_bytes, len(body))
    except APIError as e:
        raise (_as_ref(e) if req._ref else e) from None


def _checked(req: SpeechRequest, max_body_bytes: int | None, body_bytes: int) -> SpeechRequest:
    audio = len(req.voice.audio) if isinstance(req.voice, VoiceAudio) else 0  # room for it, for nothing else
    if max_body_bytes is not None and body_bytes > max_body_bytes + audio:
        raise invalid(f"the request body is larger than {max_body_bytes} bytes ('input' may have at most "
                      f"{MAX_INPUT_CHARS} characters)", "input", "string_above_max_length")
    check_model(req.model)
    if not req.input.strip():
        raise invalid("'input' is empty", "input")
    if len(req.input) > MAX_INPUT_CHARS:
        raise invalid(f"'input' has {len(req.input)} characters, more than the limit of {MAX_INPUT_CHARS}", "input",
                      "string_above_max_length")
    if req.input_format == "dialogue":
        req._dialogue = parse_dialogue(req.input, req.voices)
    elif req.voices is not None:
        raise invalid("'voices' goes with \"input_format\": \"dialogue\"", "voices")
    elif ssml.is_ssml(req.input):
        try:
            req._ssml = ssml.parse(req.input)
        except ssml.SSMLError as e:
            raise invalid(f"'input': {e}", "input", "invalid_ssml") from None
    elif not req.split and len(req.input) > LIMITS.max_text_chars:
        raise invalid(f"with split false 'input' must be at most {LIMITS.max_text_chars} characters", "input")
    check_options(req, req.model_fields_set)
    return req


def parse_dialogue(text: str, voices: dict[str, str] | None) -> list[tuple[str, str]]:
    """(voice, text) of each line of a dialogue script (`LABEL: text` lines, blank lines skipped; a label is a key of
    `voices`), or APIError(400) naming `voices` or `input` (with the line's number)."""
    if not voices:
        raise invalid("\"input_format\": \"dialogue\" needs 'voices', the voice of each speaker label "
                      "({\"A\": \"alloy\", \"B\": \"nova\"})", "voices")
    if len(voices) > MAX_DIALOGUE_SPEAKERS:
        raise invalid(f"'voices' has {len(voices)} speakers, more than {MAX_DIALOGUE_SPEAKERS}", "voices")
    labels: dict[str, str] = {}
    for label, voice in voices.items():
        name = label.strip()
        if not name or len(name) > MAX_LABEL_CHARS or re.search(r"[:：\n\r]", name):
            raise invalid(f"'voices': a speaker label is 1-{MAX_LABEL_CHARS} characters without ':' or a line break, "
                          "got "
                          f"{label[:80]!r}", "voices")
        if not voice.strip():
            raise invalid(f"'voices.{name}' is empty", "voices")
        if voice_mix.is_mix(voice):
            try:
                voice_mix.parse(voice)
            except voice_mix.MixError as e:
                raise invalid(f"'voices.{name}': {e}", "voices", "invalid_voice_mix") from None
        labels[name] = voice.strip()
    lines: list[tuple[str, str]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        shown = raw.strip() if len(raw.strip()) <= 60 else raw.strip()[:57] + "..."
        m = _DIALOGUE_LINE.match(raw)
        if m is None:
            raise invalid(f"'input' line {n} ({shown!r}) has no speaker label: each line of a dialogue is "
                          "'LABEL: text'", "input", "invalid_dialogue")
        label, said = m.group(1).strip(), m.group(2).strip()
        if label not in labels:
            raise invalid(f"'input' line {n}: speaker {label[:80]!r} is not in 'voices' (known: "
                          f"{', '.join(sorted(labels))})", "input", "unknown_speaker")
        if not speakable(said):
            raise invalid(f"'input' line {n} ({shown!r}) has nothing to speak", "input", "empty_line")
        if len(lines) == MAX_DIALOGUE_LINES:
            raise invalid(f"the dialogue in 'input' has more than {MAX_DIALOGUE_LINES} lines", "input",
                          "too_many_lines")
        lines.append((labels[label], said))
    if not lines:
        raise invalid("'input' has no dialogue line", "input")
    return lines


def check_model(model: str) -> None:
    if model not in MODELS:
        raise APIError(400, f"model {model!r} does not exist here; use one of {', '.join(MODELS)}",
                       "invalid_request_error", "model", "model_not_found")


def check_options(req, given) -> None:
    """The checks across fields of a request or a session's settings (`given`: the fields the client set)."""
    name = voice_name(req)
    if name is not None and not name.strip():
        raise invalid("'voice' is empty", "voice")
    if name is not None and voice_mix.is_mix(name):  # its terms' names are the server's to resolve
        try:
            voice_mix.parse(name)
        except voice_mix.MixError as e:
            raise invalid(f"'voice': {e}", "voice", "invalid_voice_mix") from None
    if isinstance(getattr(req, "voice", None), VoiceAudio):
        check_voice_audio(req.voice)
    try:
        check(req.response_format, req.sample_rate)
    except ValueError as e:
        raise invalid(f"'sample_rate': {e}", "sample_rate") from None
    if req.min_new_tokens is not None and req.max_new_tokens is not None and req.min_new_tokens > req.max_new_tokens:
        raise invalid("'min_new_tokens' must not exceed 'max_new_tokens'", "min_new_tokens")
    if req.prompt is not None and SPEED_TOKEN.search(req.prompt) and "speed" in given:
        raise invalid("give 'speed' or a [speed_N] token in 'prompt', not both", "speed")


def voice_name(req: SpeechRequest) -> str | None:
    """The voice's name (a mix expression too); None for a voice of reference audio."""
    if isinstance(req.voice, VoiceAudio):
        return None
    return req.voice.id if isinstance(req.voice, VoiceRef) else req.voice


def check_voice_audio(voice: VoiceAudio) -> None:
    """What can be said of a request's voice audio without decoding it: its size, its MIME type, its transcript."""
    text = voice.audio
    if re.match(r"^[a-z][a-z0-9+.-]*://", text[:16], re.IGNORECASE):
        raise invalid("'voice.audio' is a URL: this server fetches nothing; send the file as base64 or a data: URL",
                      "voice.audio", "invalid_voice_audio")
    if len(text) > MAX_VOICE_AUDIO_BASE64:
        raise invalid(f"'voice.audio' is larger than {MAX_VOICE_AUDIO_BYTES} bytes (base64: {len(text)} characters)",
                      "voice.audio", "voice_audio_too_large")
    m = _DATA_URL.match(text[:512])
    if m is not None:
        mime, params = m.group(1).strip().lower(), m.group(2).lower()
        if not (mime.startswith("audio/") or mime in ("", "application/octet-stream", "video/webm", "video/mp4",
                                                      "video/ogg")):
            raise invalid(f"'voice.audio' is a data URL of {mime!r}, not audio", "voice.audio", "invalid_voice_audio")
        if ";base64" not in params:
            raise invalid("'voice.audio' must be base64 (a data URL with ';base64')", "voice.audio",
                          "invalid_voice_audio")
    if not voice.transcript.strip():
        raise invalid("'voice.transcript' is empty: give what the reference audio says", "voice.transcript")


def decode_voice_audio(voice: VoiceAudio) -> np.ndarray:
    """The request's reference audio as SPEAKER_AUDIO: 24 kHz mono float32 within the reference-audio bounds (the
    server's own check, chattts_triton.runtime.artifacts); APIError(400) naming `voice.audio` for anything else. Blocks
    (FFmpeg): call it off the event loop."""
    from chattts_triton.model.text import InputError
    from chattts_triton.runtime.artifacts import check_reference_audio
    from chattts_triton.runtime.voices import decode_reference_audio

    check_voice_audio(voice)
    text = voice.audio
    m = _DATA_URL.match(text[:512])
    if m is not None:
        text = text[m.end():]
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise invalid(f"'voice.audio' is not base64 ({e})", "voice.audio", "invalid_voice_audio") from None
    if not data:
        raise invalid("'voice.audio' is empty", "voice.audio", "invalid_voice_audio")
    if len(data) > MAX_VOICE_AUDIO_BYTES:
        raise invalid(f"'voice.audio' is {len(data)} bytes, more than {MAX_VOICE_AUDIO_BYTES}", "voice.audio",
                      "voice_audio_too_large")
    try:
        wav = decode_reference_audio(io.BytesIO(data), what="'voice.audio'")
        check_reference_audio(wav)
    except InputError as e:
        message = str(e).replace("SPEAKER_AUDIO", "'voice.audio'")
        raise invalid(message, "voice.audio", "invalid_voice_audio") from None
    except RuntimeError as e:  # no PyAV on this host
        raise invalid(f"'voice.audio' cannot be read here: {e}", "voice.audio", "unsupported_voice_audio") from None
    return wav


async def voice_options(req: SpeechRequest) -> dict[str, Any]:
    """The contract options of a request's voice of reference audio (none for a named voice)."""
    if not isinstance(req.voice, VoiceAudio):
        return {}
    wav = await asyncio.to_thread(decode_voice_audio, req.voice)
    return {"speaker_audio": wav, "speaker_text": req.voice.transcript}


def contract_options(req: SpeechRequest) -> dict[str, Any]:
    """The SynthesisOptions fields (by name) every piece of the request gets: the body's ChatTTS inputs, `speed` as
    the prompt's speed token, the voice's name; SEED comes from the schedule, a voice of reference audio from
    `voice_options`."""
    options: dict[str, Any] = {name: getattr(req, name) for name in BODY_OPTIONS
                               if name != "seed" and getattr(req, name) is not None}
    prompt = req.prompt if req.prompt is not None else ""
    options["prompt"] = prompt if SPEED_TOKEN.search(prompt) else speed_token(req.speed) + prompt
    if voice_name(req) is not None:  # a realtime session may leave it out: the session's seed names the speaker
        options["voice"] = voice_name(req)
    return options


async def speech_job(req: SpeechRequest) -> Job:
    """The request's pieces with the options each is sent with: its text split (`split_text`), or its SSML's
    segments, each split, spoken in the segment's voice at its rate, with the silence its breaks ask for."""
    options = contract_options(req)
    seed: dict[str, Any] = {"seed": req.seed} if req.seed is not None else {}
    if req.condition_on_first_piece:
        seed["condition_on_first"] = True
    if req._dialogue is not None:  # every line in its own voice: the request's `voice` is not spoken
        return _dialogue_job(req, options, seed)
    try:
        options.update(await voice_options(req))
    except APIError as e:
        raise (_as_ref(e) if req._ref else e) from None
    if req._ssml is None:
        pieces = split_text(req.input) if req.split else [req.input]
        if not pieces:
            raise invalid("'input' has nothing to speak", "input")
        return Job(pieces, options, **seed)
    if req._ssml.needs_spoken:  # the grammars: loaded once (~0.3 s), then ~50 µs a character, off the event loop
        speech = await asyncio.to_thread(_render, req._ssml)
    else:
        speech = _render(req._ssml)
    pieces: list[str] = []
    extras: list[dict[str, Any]] = []
    gaps: list[int | None] = []  # silence before each piece (None: the usual pause between pieces)
    after: int | None = None  # the silence the breaks after the last segment ask for
    for segment in speech.segments:
        if not req.split and len(segment.text) > LIMITS.max_text_chars:
            raise invalid(f"with split false each part of the SSML 'input' must be at most {LIMITS.max_text_chars} "
                          f"characters", "input")
        extra: dict[str, Any] = {}
        if segment.voice is not None:  # in place of the request's voice, a voice of reference audio too
            extra.update(voice=segment.voice, speaker_audio=None, speaker_text=None)
        if segment.rate != 1.0:
            extra["prompt"] = ssml.with_rate(options["prompt"], segment.rate)
        texts = split_text(segment.text) if req.split else [segment.text]
        for i, text in enumerate(texts):
            gaps.append(speech.lead_ms + (after or 0) if not pieces else after if i == 0 else None)
            pieces.append(text)
            extras.append(extra)
        if texts:
            after = segment.pause_after_ms
        elif segment.pause_after_ms:
            after = (after or 0) + segment.pause_after_ms
    if not pieces:
        raise invalid("'input' has nothing to speak", "input")
    return Job(pieces, options, piece_extras=extras, gaps_ms=gaps + [after or 0], **seed)


def _dialogue_job(req: SpeechRequest, options: dict[str, Any], job_fields: dict[str, Any]) -> Job:
    """A dialogue's pieces: each line split as plain text (or whole with split false), spoken in its label's voice as
    an SSML <voice> segment is; `line_pause_ms` of silence between lines, the usual pause between a line's pieces."""
    pieces: list[str] = []
    extras: list[dict[str, Any]] = []
    gaps: list[int | None] = []
    for n, (voice, said) in enumerate(req._dialogue or ()):
        if not req.split and len(said) > LIMITS.max_text_chars:
            raise invalid(f"with split false each line of the dialogue must be at most {LIMITS.max_text_chars} "
                          f"characters (its line {n + 1} has {len(said)})", "input")
        extra = {"voice": voice, "speaker_audio": None, "speaker_text": None}
        for i, text in enumerate(split_text(said) if req.split else [said]):
            gaps.append(0 if not pieces else req.line_pause_ms if i == 0 else None)
            pieces.append(text)
            extras.append(extra)
    return Job(pieces, options, piece_extras=extras, gaps_ms=gaps + [0], **job_fields)


def _render(doc: ssml.Document) -> ssml.Speech:
    spoken = None
    if doc.needs_spoken:
        from chattts_triton.model.spoken import default

        spoken = default()
    return ssml.render(doc, spoken, breaks="silence")


def speed_table() -> list[tuple[float, float, str]]:
    """(from, below, token) rows of the speed mapping (docs)."""
    edges = (0.25,) + SPEED_UPPER_BOUNDS + (math.inf,)
    return [(edges[i], edges[i + 1], f"[speed_{i}]") for i in range(len(edges) - 1)]


# the contract input a server error names -> the body field a client sent it as
FIELD_OF_INPUT = {"TEXT": "input", "VOICE": "voice", "PROMPT": "speed", "SPEAKER_AUDIO": "voice.audio",
                  "SPEAKER_TEXT": "voice.transcript"}
assert InferCodeParams.prompt == speed_token(1.0)  # speed 1.0 is upstream's default prompt


def field_of(input_name: str | None, req: SpeechRequest | None = None) -> str | None:
    if input_name is None:
        return None
    if input_name == "PROMPT" and req is not None and req.prompt is not None:
        return "prompt"
    if input_name == "VOICE" and req is not None and getattr(req, "_dialogue", None) is not None:
        return "voices"  # a dialogue's voices are its speakers'
    return FIELD_OF_INPUT.get(input_name, input_name.lower())
