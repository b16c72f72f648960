"""The named voices over HTTP: the voice store every gateway and Triton instance reads
(chattts_triton/runtime/stores.py, the `voice_store` URL; docs/voices.md).

    GET    /v1/audio/voices          the voices VOICE can name: id, source, builtin, description
    GET    /v1/audio/voices/{id}     one voice in full, with its speaker (or reference sample) string to keep elsewhere
    POST   /v1/audio/voices          add one (admin): JSON {"name", "seed" | "speaker" | "mix", "description",
                                     "replace"},
                                     or multipart/form-data: name, audio (a recording in any common format), transcript
                                     (what it says), description, replace: stored as the speaker sample, as upstream's
                                     `sample_audio_speaker`
    DELETE /v1/audio/voices/{id}     remove one (admin)

Writes need the admin key (`--admin-key` or env CHATTTS_ADMIN_KEY, sent as `Authorization: Bearer KEY`); a gateway with
none takes writes only while it listens on a loopback address, and answers 403 otherwise. Every fault of a write is a
4xx naming the field (OpenAI's error body) and changes nothing; a write is one transaction of the store, seen by every
gateway and by chattts_preprocess within the store's poll interval.

A seed voice is stored as its seed (each reader makes the speaker for its model); a speaker string is checked against
the served model's hidden size, a mix is made from the store's voices as the voices CLI makes it, and a recording is
decoded here (PyAV, as a request's `voice.audio`) and encoded by the server's own DVAE encoder (chattts_preprocess's
AUDIO_PROMPT output), so that a stored voice of audio is what `voice: {"audio", "transcript"}` would give.
"""

from __future__ import annotations

import asyncio
import hmac
import io
import ipaddress
import json
import logging
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from chattts_triton.config import GPT, LIMITS, MANIFEST, NUM_VQ, PREPROCESS
from chattts_triton.launcher.serve import ADMIN_KEY_ENV  # one admin key: Triton's restricted APIs and these writes
from chattts_triton.model import mix as voice_mix
from chattts_triton.model import speaker as spk
from chattts_triton.model.text import InputError, validate_text
from chattts_triton.runtime import stores
from chattts_triton.runtime import voices as V

from . import api

log = logging.getLogger("chattts_gateway")


MAX_JSON_BYTES = 64 << 10  # a speaker string is ≈ 2.6 KB of UTF-8
MAX_FORM_BYTES = api.MAX_VOICE_AUDIO_BYTES + (64 << 10)  # the recording, its transcript and the form's framing
FORM_FIELDS = ("name", "audio", "transcript", "description", "replace")
AUDIO_TYPES = ("application/octet-stream", "video/webm", "video/mp4", "video/ogg", "video/quicktime")
MAX_SEED = 2**64 - 1  # torch.manual_seed's range
_SOURCES = ("seed", "speaker", "mix")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorize_write(gw, request: Request) -> None:
    """The rule of every write to the voice store (the voices, the lexicon: gateway/lexicon_http.py): the admin key
    (`--admin-key` or env CHATTTS_ADMIN_KEY) as `Authorization: Bearer KEY`; without one, a gateway on a loopback
    address only (what speech needs, an API key where the gateway has keys), else 403."""
    settings = gw.settings
    key = settings.admin_key
    if not key:
        if not is_loopback(settings.host):
            raise api.APIError(403, f"writes to the voice store need the admin key: this gateway listens on "
                                    f"{settings.host}; start it with --admin-key or {ADMIN_KEY_ENV} and send "
                                    f"'Authorization: Bearer KEY' (without a key, writes are taken on 127.0.0.1 "
                                    f"only)", "permission_error", None, "admin_key_required")
        gw.authenticate(request)
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise api.APIError(401, "writes to the voice store need the admin key: 'Authorization: Bearer KEY'",
                           "invalid_request_error", None, "missing_admin_key", {"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise api.APIError(403, "incorrect admin key: writes to the voice store need the admin key",
                           "permission_error", None, "invalid_admin_key")


class VoiceBody(BaseModel):
    """`POST /v1/audio/voices` as JSON: a name and one source."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    speaker: str | None = Field(None, max_length=4096)
    mix: str | None = Field(None, max_length=voice_mix.MAX_CHARS)
    description: str = Field("", max_length=V.MAX_DESCRIPTION_CHARS)
    replace: bool = False


def _invalid(message: str, param: str | None, code: str | None = None) -> api.APIError:
    return api.invalid(message, param, code)


def _not_found(name: str) -> api.APIError:
    return api.APIError(404, f"no voice {name!r} in the voice store (GET /v1/audio/voices lists them)",
                        "invalid_request_error", "id", "voice_not_found")


def _store_failed(e: stores.StoreError) -> api.APIError:
    if isinstance(e, stores.StoreUnavailable):
        return api.APIError(503, f"the voice store is unavailable, retry later ({e})", "server_error", None,
                            "voice_store_unavailable", {"Retry-After": "1"})
    return api.APIError(500, f"the voice store failed: {e}", "server_error", None, "voice_store_error")


def checked_name(name: Any, param: str = "name") -> str:
    if not isinstance(name, str):
        raise _invalid(f"'{param}' must be a string", param)
    try:
        return V.check_name(name)
    except InputError as e:
        shown = name if len(name) <= 70 else name[:67] + "..."
        message = str(e).replace(repr(name), repr(shown))
        raise _invalid(f"'{param}': {message}", param, "invalid_voice_name") from None


def voice_json(name: str, voice: V.Voice, full: bool = False) -> dict[str, Any]:
    """A voice as the API shows it: its listing entry, and with `full` what it is made of."""
    out: dict[str, Any] = {"id": name, "name": name, "object": "voice", "source": voice.source,
                           "builtin": voice.builtin}
    if voice.description:
        out["description"] = voice.description
    if full:
        for key, value in (("seed", voice.seed), ("mix", voice.mix), ("speaker", voice.speaker),
                           ("sample", voice.sample), ("transcript", voice.text)):
            if value is not None:
                out[key] = value
    return out


class VoicesAPI:
    """The routes' work over the gateway's voice store (None: no store configured, the built-ins read-only)."""

    def __init__(self, gw):
        self.gw = gw
        self.settings = gw.settings
        url = V.store_url(self.settings.repo, self.settings.voice_store)
        self.store: stores.DocumentStore | None = None
        if url or self.settings.repo is not None:
            self.store = V.open_voice_store(url, self.settings.repo)
        self._hidden: int | None = None

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    # --- guards -------------------------------------------------------------------------------------
    def authorize_write(self, request: Request) -> None:
        authorize_write(self.gw, request)

    def writable(self) -> stores.DocumentStore:
        if self.store is None:
            raise api.APIError(501, "this gateway has no voice store: start it with --voice-store URL (or --repo REPO, "
                                    "the repository's voices.json)", "invalid_request_error", None,
                               "voice_store_not_configured")
        return self.store

    # --- reads --------------------------------------------------------------------------------------
    async def docs(self) -> stores.Docs:
        if self.store is None:
            return V.initial_docs()
        try:
            return (await asyncio.to_thread(self.store.snapshot))[1]
        except stores.StoreError as e:
            raise _store_failed(e) from None

    async def listing(self) -> list[dict[str, Any]]:
        voices, broken = V.voices_of(await self.docs())
        if broken:
            log.error("voice store: unreadable voices %s", broken)
        return [voice_json(n, v) for n, v in sorted(voices.items())]

    async def one(self, name: str) -> dict[str, Any]:
        doc = (await self.docs()).get(name)
        if doc is None:
            raise _not_found(name)
        voices, broken = V.voices_of({name: doc})
        if name in broken:
            raise api.APIError(500, f"voice {name!r} is unreadable: {broken[name]}", "server_error", None,
                               "voice_unreadable")
        return voice_json(name, voices[name], full=True)

    async def delete(self, request: Request, name: str) -> dict[str, Any]:
        self.authorize_write(request)
        store = self.writable()
        try:
            gone = await asyncio.to_thread(V.delete_voice, store, name)
        except stores.StoreError as e:
            raise _store_failed(e) from None
        if not gone:
            raise _not_found(name)
        log.info("voice %r removed from the voice store", name)
        return {"id": name, "object": "voice", "deleted": True}

    # --- writes -------------------------------------------------------------------------------------
    async def create(self, request: Request) -> JSONResponse:
        self.authorize_write(request)
        store = self.writable()
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "application/json":
            voice, replace = await self._from_json(await bounded_body(request, MAX_JSON_BYTES, None))
        elif kind == "multipart/form-data":
            voice, replace = await self._from_form(request)
        else:
            raise api.APIError(415, f"Content-Type {kind or '(none)'!r}: a voice is application/json (a seed, speaker "
                                    f"string or mix) or multipart/form-data (a recording and its transcript)",
                               "invalid_request_error", "Content-Type", "unsupported_media_type")
        try:
            await asyncio.to_thread(store.put, voice.name, voice.to_json(), replace)
        except stores.Exists:
            raise api.APIError(409, f"'name': a voice {voice.name!r} exists; DELETE it first or send \"replace\": true",
                               "invalid_request_error", "name", "voice_exists") from None
        except stores.Full as e:
            raise api.APIError(409, f"the voice store is full: {e}; DELETE a voice first", "invalid_request_error",
                               "name", "voice_store_full") from None
        except stores.StoreError as e:
            if "more than the limit" in str(e):
                raise _invalid(f"the voice is too large to store: {e}", "description", "voice_too_large") from None
            raise _store_failed(e) from None
        log.info("voice %r stored (%s)", voice.name, voice.source)
        return JSONResponse(voice_json(voice.name, voice, full=True), status_code=201)

    async def _from_json(self, body: bytes) -> tuple[V.Voice, bool]:
        try:
            raw = json.loads(body)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise _invalid(f"the body must be a JSON object ({why})", None) from None
        if not isinstance(raw, dict):
            raise _invalid(f"the body must be a JSON object, got {type(raw).__name__}", None)
        if "name" not in raw:
            raise _invalid("'name' is a required property", "name")
        checked_name(raw["name"])
        try:
            req = VoiceBody.model_validate(raw)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            field = ".".join(str(x) for x in err.get("loc", ())) or None
            if err.get("type") == "extra_forbidden":
                raise _invalid(f"'{field}' is not a field of a voice (fields: name, seed, speaker, mix, description, "
                               f"replace; a recording goes as multipart/form-data)", field) from None
            got = err.get("input")
            shown = repr(got) if isinstance(got, (int, float, bool,
                                                  type(None))) or (isinstance(got, str) and len(got) < 60) \
                else type(got).__name__
            raise _invalid(f"'{field}': {err.get('msg')}, got {shown}", field) from None
        given = [k for k in _SOURCES if getattr(req, k) is not None]
        if len(given) != 1:
            raise _invalid(f"a voice is made of one of 'seed', 'speaker' or 'mix' (a recording: multipart/form-data), "
                           f"got {', '.join(repr(k) for k in given) or 'none'}", given[-1] if given else "seed")
        if req.seed is not None:
            return V.Voice(req.name, seed=req.seed, description=req.description), req.replace
        hidden = await self.hidden()
        if req.speaker is not None:
            try:
                spk.decode_speaker(req.speaker, hidden)
            except InputError as e:
                raise _invalid(f"'speaker': {e}", "speaker", "invalid_speaker") from None
            return V.Voice(req.name, speaker=req.speaker.strip(), description=req.description), req.replace
        return await self._mix(req.name, req.mix, req.description, hidden), req.replace

    async def _mix(self, name: str, expr: str, description: str, hidden: int) -> V.Voice:
        try:
            voice_mix.parse(expr)
        except voice_mix.MixError as e:
            raise _invalid(f"'mix': {e}", "mix", "invalid_voice_mix") from None
        registry = V.VoiceRegistry(self.store, hidden)

        def make() -> V.Voice:
            return V.mix_voice(expr, registry.resolve, hidden, name)

        try:
            mixed = await asyncio.to_thread(make)
        except InputError as e:
            raise _invalid(str(e).replace("VOICE", "'mix'", 1), "mix", "invalid_voice_mix") from None
        except stores.StoreError as e:
            raise _store_failed(e) from None
        return V.Voice(name, speaker=mixed.speaker, mix=mixed.mix, description=description)

    async def _from_form(self, request: Request) -> tuple[V.Voice, bool]:  # noqa: C901  a form's checks, one after another: each is one branch that refuses
        body = await bounded_body(request, MAX_FORM_BYTES, "audio")

        async def replay() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            form = await Request(request.scope, replay).form(max_files=1, max_fields=len(FORM_FIELDS),
                                                              max_part_size=MAX_JSON_BYTES)
        except StarletteHTTPException as e:
            raise _invalid(f"the multipart body cannot be read: {e.detail}", None, "invalid_multipart") from None
        try:
            for key in form.keys():
                if key not in FORM_FIELDS:
                    raise _invalid(f"'{key[:40]}' is not a field of a voice (a form has name, audio, transcript, "
                                   f"description, replace)", key[:40])
                if len(form.getlist(key)) > 1:
                    raise _invalid(f"'{key}' is given more than once", key)
            name = form.get("name")
            if name is None:
                raise _invalid("'name' is a required property", "name")
            name = checked_name(name)
            audio, transcript = form.get("audio"), form.get("transcript")
            description, replace = form.get("description", ""), form.get("replace", "false")
            if audio is None:
                raise _invalid("'audio' is a required property: the recording, as a file part", "audio")
            if not isinstance(audio, UploadFile):
                raise _invalid("'audio' must be a file part (curl -F audio=@voice.wav), not a text field", "audio",
                               "invalid_voice_audio")
            if transcript is None:
                raise _invalid("'transcript' is a required property: what the recording says", "transcript")
            for field, value in (("transcript", transcript), ("description", description), ("replace", replace)):
                if not isinstance(value, str):
                    raise _invalid(f"'{field}' must be a text field, not a file", field)
            if not transcript.strip():
                raise _invalid("'transcript' is empty: give what the recording says", "transcript")
            if len(transcript) > LIMITS.max_text_chars:
                raise _invalid(f"'transcript' has {len(transcript)} characters, more than {LIMITS.max_text_chars}",
                               "transcript")
            if len(description) > V.MAX_DESCRIPTION_CHARS:
                raise _invalid(f"'description' has {len(description)} characters, more than "
                               f"{V.MAX_DESCRIPTION_CHARS}", "description")
            if replace.lower() not in ("true", "false", "1", "0"):
                raise _invalid(f"'replace' must be true or false, got {replace[:20]!r}", "replace")
            try:
                validate_text(transcript, what="'transcript'")
            except InputError as e:
                raise _invalid(str(e), "transcript") from None
            mime = (audio.content_type or "").split(";")[0].strip().lower()
            if mime and not (mime.startswith("audio/") or mime in AUDIO_TYPES):
                raise _invalid(f"'audio' is {mime!r}, not audio (a recording: wav, mp3, flac, ogg/opus, webm, m4a)",
                               "audio", "invalid_voice_audio")
            data = await audio.read()
        finally:
            await form.close()
        if not data:
            raise _invalid("'audio' is empty", "audio", "invalid_voice_audio")
        if len(data) > api.MAX_VOICE_AUDIO_BYTES:
            raise _invalid(f"'audio' is {len(data)} bytes, more than {api.MAX_VOICE_AUDIO_BYTES}", "audio",
                           "voice_audio_too_large")
        wav = await asyncio.to_thread(_decode, data)
        sample = await self.reference_sample(wav, transcript)
        voice = V.Voice(name, sample=sample, text=transcript, description=description)
        return voice, replace.lower() in ("true", "1")

    # --- what the served model says ----------------------------------------------------------------
    async def hidden(self) -> int:
        """The served GPT's hidden size (a speaker's length): the repository's manifest, else the server's
        configuration of chattts_gpt (its HIDDENS output)."""
        if self._hidden is None:
            repo = self.settings.repo
            if repo is not None and (repo / MANIFEST).is_file():
                self._hidden = int(json.loads((repo / MANIFEST).read_text(encoding="utf-8"))["arch"]["gpt"]["hidden"])
            else:
                self._hidden = await self._served_hidden()
        return self._hidden

    async def _served_hidden(self) -> int:
        import tritonclient.grpc.aio as aio

        client = aio.InferenceServerClient(self.settings.grpc_url)
        try:
            config = (await client.get_model_config(GPT, as_json=True))["config"]
        except Exception as e:  # noqa: BLE001  every failure of the call is the server's unavailability
            raise api.APIError(503, f"the TTS server cannot say its model's speaker size, retry later ({e})",
                               "server_error", None, "server_unavailable", {"Retry-After": "1"}) from None
        finally:
            await client.close()
        dims = next(o["dims"] for o in config["output"] if o["name"] == "HIDDENS")
        return int(dims[-1])

    async def reference_sample(self, wav: np.ndarray, transcript: str) -> str:
        """The reference sample string (spk_smp) the server's DVAE encoder makes of a recording: chattts_preprocess's
        AUDIO_PROMPT for SPEAKER_AUDIO, with SPEAKER_TEXT checked by the server as a request's would be."""
        import tritonclient.grpc as module
        import tritonclient.grpc.aio as aio

        from client.contract import build_inputs, to_infer_inputs
        from client.errors import to_chattts_error

        from .app import api_error
        from .synth import synthesis_error

        arrays = build_inputs("a", {"speaker_audio": wav, "speaker_text": transcript, "refine_text": False,
                                    "normalize_text": False})
        client = aio.InferenceServerClient(self.settings.grpc_url)
        try:
            result = await client.infer(PREPROCESS, to_infer_inputs(module, arrays),
                                        outputs=[module.InferRequestedOutput("AUDIO_PROMPT")],
                                        client_timeout=self.settings.timeout_s)
        except Exception as exc:  # noqa: BLE001  every failure of the call becomes a canonical status
            err = synthesis_error(to_chattts_error(exc, f"grpc://{self.settings.grpc_url} model '{PREPROCESS}'"))
            failure = api_error(err)
            if failure.status == 400:
                field = {"SPEAKER_AUDIO": "audio", "SPEAKER_TEXT": "transcript"}.get(err.field or "", "audio")
                failure = _invalid(err.message.replace("SPEAKER_AUDIO",
                                                       "'audio'").replace("SPEAKER_TEXT", "'transcript'"),
                                   field, "invalid_voice_audio" if field == "audio" else None)
            raise failure from None
        finally:
            await client.close()
        codes = result.as_numpy("AUDIO_PROMPT").reshape(-1, NUM_VQ).T
        return spk.encode_prompt(codes)


def _decode(data: bytes) -> np.ndarray:
    """The recording at the model's rate within the reference-audio bounds; APIError(400) naming 'audio'."""
    from chattts_triton.runtime.artifacts import check_reference_audio

    try:
        wav = V.decode_reference_audio(io.BytesIO(data), what="'audio'")
        check_reference_audio(wav)
    except InputError as e:
        raise _invalid(str(e).replace("SPEAKER_AUDIO", "'audio'"), "audio", "invalid_voice_audio") from None
    except RuntimeError as e:  # no PyAV on this host
        raise _invalid(f"'audio' cannot be read here: {e}", "audio", "unsupported_voice_audio") from None
    if not np.isfinite(wav).all() or not wav.size:
        raise _invalid("'audio' holds no finite samples", "audio", "invalid_voice_audio")
    return wav


async def bounded_body(request: Request, limit: int, field: str | None,
                       small: str = "a voice's JSON is small") -> bytes:
    """The body, at most `limit` bytes of it: a larger one is read to its end (up to DRAIN_BYTES, so that a client
    still sending gets the answer rather than a reset connection) and refused naming `field` (without one, saying
    `small`), as the speech API does."""
    from .app import DRAIN_BYTES  # the speech API's bound of what is drained

    data, seen = bytearray(), 0
    async for part in request.stream():
        seen += len(part)
        if seen <= limit:
            data += part
        elif seen > DRAIN_BYTES:
            break
    if seen > limit:
        what = f"'{field}' may be at most {api.MAX_VOICE_AUDIO_BYTES} bytes" if field else small
        raise _invalid(f"the request body is larger than {limit} bytes ({what})", field, "body_too_large")
    return bytes(data)


def install(app: FastAPI, gw) -> VoicesAPI:
    """The routes on `app`, over the gateway `gw`'s settings and authentication."""
    voices = VoicesAPI(gw)
    app.state.voices = voices

    @app.get("/v1/audio/voices")
    async def list_voices(request: Request):
        gw.authenticate(request)
        return {"object": "list", "voices": await voices.listing()}

    @app.get("/v1/audio/voices/{voice_id}")
    async def get_voice(voice_id: str, request: Request):
        gw.authenticate(request)
        return await voices.one(voice_id)

    @app.post("/v1/audio/voices")
    async def create_voice(request: Request):
        return await voices.create(request)

    @app.delete("/v1/audio/voices/{voice_id}")
    async def delete_voice(voice_id: str, request: Request):
        return await voices.delete(request, voice_id)

    return voices

