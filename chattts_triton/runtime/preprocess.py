"""`chattts_preprocess`: TEXT and the speaker inputs → the GPT's prompt tensors (SSML, the pronunciation lexicon,
normalisation, voices, reference audio, refine-text through the GPT model)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import (
    DRAIN_FILE_ENV,
    LIMITS,
    NORMALIZE_TEXT_DEFAULT,
    NUM_VQ,
    REFINE_TEXT_DEFAULT,
    VOICE_STORE_ENV,
    Arch,
    InferCodeParams,
    RefineTextParams,
)
from ..model import speaker as spk
from ..model import ssml
from ..model import text as txt
from ..model.text import InputError
from .artifacts import Artifact, check_reference_audio, reference_codes
from .inputs import Call, Outputs, Overloaded, get_bool, get_str, named, refine_params
from .lexicon import LexiconRegistry, open_lexicon_store
from .stores import env_or, shown_url
from .voices import Voice, VoiceRegistry, open_voice_store

log = logging.getLogger(__name__)


class PreprocessService:
    """TEXT and speaker inputs → GPT prompt tensors. Refine-text runs on the GPT model (`refine`)."""

    def __init__(self, version_dir: Path, arch: Arch, device: torch.device, artifact_format: str,
                 refine: Callable[[np.ndarray, dict[str, Any]], np.ndarray] | None = None, workers: int = 4,
                 max_pending: int = 0, voice_store: str = ""):
        """max_pending: requests held (being prepared) at most, beyond which one is answered "server busy"
        at once (0: no bound); the configuration gives what the GPT engines admit together. voice_store: where the
        named voices are kept (runtime/stores.py; env CHATTTS_VOICE_STORE in its place where set; empty: the
        repository's voices.json)."""
        self.arch = arch
        self.max_pending = max_pending
        self.pending = 0
        self.lock = threading.Lock()
        self.tokenizer = txt.TextTokenizer(Path(version_dir) / "tokenizer")
        from ..model.spoken import default as spoken_form  # the grammars: ~0.3 s and ~45 MB, once per process

        self.spoken = spoken_form()
        self.normalizer = txt.Normalizer(spoken=self.spoken)
        # cumulative, for metrics (triton/backend.py STAT_HELP): what normalisation removed without a trace in the audio
        self.text_counters = {"text_normalized": 0, "text_with_removed_chars": 0, "text_removed_chars": 0}
        self.text_lock = threading.Lock()
        self.refine = refine
        # Reference audio is encoded once per request on the CPU: the TorchScript encoder hangs on
        # CUDA with the JIT fuser on (seen with torch 2.11), and it is not on the hot path.
        self.encoder_path = (Path(version_dir) / "dvae_encode", artifact_format, torch.device("cpu"))
        self._encoder: Artifact | None = None
        # named voices: the store the setting names, by default REPO/voices.json beside the model folders (version_dir
        # is REPO/MODEL/1)
        repo = Path(version_dir).parent.parent
        url = env_or(voice_store, VOICE_STORE_ENV)
        store = open_voice_store(url, repo)
        log.info("named voices from %s", shown_url(store.url))
        self.voices = VoiceRegistry(store, arch.gpt.hidden)
        # the pronunciation lexicon: kept where the voices are (REPO/lexicon.json by default), followed as they are
        self.lexicon = LexiconRegistry(open_lexicon_store(url, repo))
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="chattts-pre")
        # Triton 2.51 fails in-flight ensemble requests at their next step once it got SIGTERM, so
        # the launcher drains first: it creates this file, waits for idle, then signals Triton
        self.drain_file = os.environ.get(DRAIN_FILE_ENV, "")

    def execute(self, calls: Sequence[Call]) -> None:
        draining = bool(self.drain_file) and os.path.exists(self.drain_file)
        for c in calls:  # refine waits on the GPT model: never block the other requests
            if draining:  # the entry of the ensemble: nothing new starts once the launcher drains
                c.reply(Overloaded("server is shutting down, retry on another instance"))
                continue
            with self.lock:
                busy = bool(self.max_pending) and self.pending >= self.max_pending
                self.pending += not busy
            if busy:
                c.reply(Overloaded(f"server busy: {self.max_pending} requests in flight, retry later"))
            else:
                self.pool.submit(self._run, c)

    def _run(self, call: Call) -> None:
        try:
            out = self.prepare(call.inputs)
        except Exception as e:  # noqa: BLE001  every failure becomes this request's error
            out = e
        finally:
            with self.lock:
                self.pending -= 1
        call.reply(out)

    def encoder(self) -> Artifact:
        if self._encoder is None:
            self._encoder = Artifact(*self.encoder_path)
        return self._encoder

    def reference_codes(self, inputs, voice: Voice | None = None) -> np.ndarray | None:
        """spk_smp codes [4, T] from SPEAKER_SAMPLE, SPEAKER_AUDIO or the voice (more than one: an error)."""
        sample = get_str(inputs, "SPEAKER_SAMPLE")
        audio = inputs.get("SPEAKER_AUDIO")
        if sample is not None and audio is not None:
            raise InputError("give SPEAKER_SAMPLE or SPEAKER_AUDIO, not both")
        if voice is not None and voice.sample is not None:
            if sample is not None or audio is not None:
                raise InputError(f"VOICE {voice.name!r} holds a reference sample: give VOICE or "
                                 f"{'SPEAKER_SAMPLE' if sample is not None else 'SPEAKER_AUDIO'}, not both")
            return named("VOICE", spk.decode_prompt, voice.sample)
        if sample is not None:
            return named("SPEAKER_SAMPLE", spk.decode_prompt, sample)
        if audio is None:
            return None
        wav = np.asarray(audio, dtype=np.float32).reshape(-1)
        check_reference_audio(wav)
        return reference_codes(self.encoder(), wav)

    def voice_inputs(self, inputs, ssml_voice: str | None = None) -> tuple[Voice | None, str | None, str | None]:
        """(voice, speaker string, reference transcript): VOICE (or the voice SSML's <voice> names) resolved in the
        repository's registry; an explicit SPEAKER / SPEAKER_TEXT for what the voice also holds is an error naming
        both."""
        speaker = get_str(inputs, "SPEAKER")
        txt_smp = get_str(inputs, "SPEAKER_TEXT")
        name = get_str(inputs, "VOICE")
        if ssml_voice is not None:
            if name is not None and name != ssml_voice:
                raise InputError(f"TEXT: SSML <voice name={ssml_voice!r}> is not VOICE {name!r}: one request speaks in "
                                 f"one voice; leave VOICE out or send each voice's part as a request of its own")
            name = ssml_voice
        if name is None:
            return None, speaker, txt_smp
        voice = self.voices.resolve(name)
        if voice.speaker is not None:
            if speaker is not None:
                raise InputError(f"VOICE {name!r} holds a speaker: give VOICE or SPEAKER, not both")
            speaker = voice.speaker
        if voice.text is not None:
            if txt_smp is not None:
                raise InputError(f"VOICE {name!r} holds a reference transcript: give VOICE or SPEAKER_TEXT, not both")
            txt_smp = voice.text
        return voice, speaker, txt_smp

    def prepare(self, inputs) -> Outputs:
        raw = get_str(inputs, "TEXT")
        text = None if ssml.is_ssml(raw) else txt.validate_text(raw)  # SSML: what it reads is checked
        prompt = txt.validate_prompt(get_str(inputs, "PROMPT", InferCodeParams.prompt))
        refine_params(inputs)  # bad REFINE_* values are rejected even when REFINE_TEXT is off
        txt.validate_prompt(get_str(inputs, "REFINE_PROMPT", RefineTextParams.prompt), what="REFINE_PROMPT")
        ssml_voice = None
        if text is None:
            text, prompt, ssml_voice = self.from_ssml(raw, prompt)
        if get_bool(inputs, "NORMALIZE_TEXT", NORMALIZE_TEXT_DEFAULT):  # off: TEXT is read as sent, lexicon too
            text = self.normalize(self.lexicon.apply(text))
        voice, speaker, txt_smp = self.voice_inputs(inputs, ssml_voice)  # an unknown voice fails before any refine
        if get_bool(inputs, "REFINE_TEXT", REFINE_TEXT_DEFAULT):
            text = self.refine_text(text, inputs)
        emb = named("SPEAKER", spk.speaker_embedding, speaker, self.arch.gpt.hidden) if speaker else None
        if txt_smp is not None:
            txt_smp = txt.validate_text(txt_smp, what="SPEAKER_TEXT")
        cp = txt.build_code_prompt(
            self.tokenizer, text, prompt, spk_emb=emb is not None, txt_smp=txt_smp,
            spk_smp_codes=self.reference_codes(inputs, voice), max_tokens=LIMITS.max_prompt_tokens,
        )
        return {
            "TEXT_IDS": cp.text_ids.reshape(1, -1),
            "SPK_EMB": (emb.numpy() if emb is not None else np.zeros(0, np.float32)).reshape(1, -1).astype(np.float32),
            "AUDIO_PROMPT": cp.audio_codes.reshape(1, -1, NUM_VQ),
            "SPOKEN_TEXT": np.array([[text.encode("utf-8")]], dtype=np.object_),  # what the GPT reads
        }

    def from_ssml(self, document: str, prompt: str) -> tuple[str, str, str | None]:
        """(text, prompt, voice) of an SSML TEXT (model/ssml.py; docs/ssml.md): one text, so a break is a ChatTTS pause
        token, a prosody rate the prompt's [speed_N], and a document in more than one voice or rate is refused."""
        if len(document) > LIMITS.max_text_chars:
            raise InputError(f"TEXT has {len(document)} characters, more than the limit of {LIMITS.max_text_chars}")
        doc = named("TEXT", ssml.parse, document)
        segment = named("TEXT", ssml.single, ssml.render(doc, self.spoken, breaks="tokens"))
        text = txt.validate_text(segment.text, what="TEXT (as its SSML reads)")
        return text, ssml.with_rate(prompt, segment.rate), segment.voice

    def normalize(self, text: str) -> str:
        """TEXT in spoken form through the upstream step; what that removed is counted and logged, and a text it
        removed entirely is refused naming what it removed."""
        result = self.normalizer.normalize(text)
        removed = sum(result.removed.values())
        with self.text_lock:
            c = self.text_counters
            c["text_normalized"] += 1
            if removed:
                c["text_with_removed_chars"] += 1
                c["text_removed_chars"] += removed
        if removed:
            log.debug("TEXT: normalisation removed %d character(s) the voice cannot say: %s", removed,
                      txt.describe_characters(result.removed))
        if not txt.TAG_RE.sub("", result.text).strip():
            if removed:
                raise InputError(f"TEXT has nothing left to speak after normalization: it removed "
                                 f"{txt.describe_characters(result.removed)} (only Chinese, English letters and "
                                 f"numbers are spoken)")
            raise InputError("TEXT has nothing to speak: only control tokens")
        return result.text

    def stats(self) -> dict[str, float]:
        """Published as the instance's `chattts_*` gauges (triton/backend.py STAT_HELP)."""
        with self.text_lock:
            return dict(self.text_counters)

    def refine_text(self, text: str, inputs) -> str:
        if self.refine is None:
            raise InputError("REFINE_TEXT is not available on this server")
        refine_prompt = txt.validate_prompt(get_str(inputs, "REFINE_PROMPT", RefineTextParams.prompt),
                                            what="REFINE_PROMPT")
        ids = txt.build_refine_prompt(self.tokenizer, text, refine_prompt)
        params = refine_params(inputs)
        if "SEED" in inputs:
            params["SEED"] = inputs["SEED"]
        tokens = self.refine(ids, params)
        return txt.refined_text(self.tokenizer, tokens.reshape(-1).tolist())

    def close(self) -> None:
        self.pool.shutdown(wait=True)

