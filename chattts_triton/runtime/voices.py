"""Named voices stored in the model repository: `REPO/voices.json`, read by every model that prepares a
request (`chattts_preprocess`, `chattts_stream`) and so shared by every replica that serves the repository.

A voice is what upstream `InferCodeParams` takes as a speaker: a speaker embedding string (`spk_emb`, e.g. the
speaker `torch.manual_seed(seed); Chat.sample_random_speaker()` gives), and/or a reference-audio prompt
(`spk_smp`, the DVAE codes of a recording) with its transcript (`txt_smp`). The contract input `VOICE` names
one; a decimal number that is no stored name is the seed's speaker (`VOICE=2222`, as ChatTTS users share
voices); a mix of them (`VOICE="2222*0.7+nova*0.3"`, model/mix.py) is one speaker embedding, their weighted average
held to the speaker distribution, and can be stored as a voice of its own (`add NAME --mix EXPR`). A repository
without voices.json (exported before it existed) serves the built-in voices (`config.BUILTIN_VOICE_SEEDS`).

    python -m chattts_triton.voices --repo REPO list
    python -m chattts_triton.voices --repo REPO add NAME --seed 2222
    python -m chattts_triton.voices --repo REPO add NAME --speaker @speaker.txt
    python -m chattts_triton.voices --repo REPO add NAME --audio reference.wav --text "what it says"
    python -m chattts_triton.voices --repo REPO add NAME --mix "2222*0.7+nova*0.3"
    python -m chattts_triton.voices --repo REPO remove NAME

Where the voices are kept is one URL, the setting `voice_store` (runtime/stores.py; docs/voices.md): empty, the
repository's voices.json; `sqlite:///PATH` a database on this machine; `redis://…` or `postgresql://…` a server every
replica shares (the CLI takes it as --voice-store, the gateway too, which also adds voices over HTTP:
gateway/voices_http.py). Edits are atomic (voices.json: written aside, renamed over it, under a lock on its folder; a
server: one transaction); a running server sees them at its next request that names a voice (a file's identity is
checked each time, a server's generation counter at most every stores.POLL_S seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..config import BUILTIN_VOICE_SEEDS, LIMITS, MANIFEST, PREPROCESS, SAMPLE_RATE, VOICE_STORE_ENV, VOICES
from ..model import mix as voice_mix
from ..model import speaker as spk
from ..model.text import InputError, validate_text
from .stores import (
    Docs,
    DocumentStore,
    Exists,
    FileStore,
    Follower,
    StoreError,
    env_or,
    file_store_path,
    folder_lock,
    open_server_store,
    shown_url,
    write_json_atomically,
)

log = logging.getLogger(__name__)

FORMAT = 1  # voices.json "format"
# Names: what an HTTP client can put in a JSON string and a shell in an argument without quoting; never all
# digits (a number is a seed)
NAME_RE = re.compile(r"^(?!\d+$)[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SEED_RE = re.compile(r"^\d{1,20}$")
LISTED_IN_ERRORS = 40  # an unknown voice's error lists at most this many names


NAMESPACE = "voices"  # the voices' namespace in a shared store
FIELDS = frozenset({"speaker", "sample", "text", "seed", "builtin", "description", "mix"})  # of a stored voice
MAX_DESCRIPTION_CHARS = 200


class VoiceFileError(StoreError):
    """voices.json cannot be read or holds something that is not a voice: a server-side fault."""


@dataclass(frozen=True)
class Voice:
    name: str
    speaker: str | None = None  # spk_emb string
    sample: str | None = None  # spk_smp string (reference-audio codes)
    text: str | None = None  # txt_smp: the transcript of the reference audio
    seed: int | None = None  # where the speaker came from, when a seed
    builtin: bool = False
    description: str = ""
    mix: str | None = None  # where the speaker came from, when a mix (its terms with normalised weights)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("speaker", "sample", "text", "seed", "mix") if getattr(self, k) is not None}
        if self.builtin:
            d["builtin"] = True
        if self.description:
            d["description"] = self.description
        return d

    @property
    def source(self) -> str:
        """What the voice is made of, in a few words (listings)."""
        if self.seed is not None:
            return f"seed {self.seed}"
        if self.mix is not None:
            return f"mix {self.mix}"
        parts = (["speaker string"] if self.speaker else []) + (["reference audio"] if self.sample else [])
        return " + ".join(parts)

    def materialized(self, hidden: int) -> Voice:
        """The voice with its speaker made: a voice stored as its seed alone (a built-in one in a shared store, or one
        added over HTTP) gets the speaker the seed gives for this hidden size."""
        if self.seed is None or self.speaker is not None or self.sample is not None:
            return self
        return seed_voice(self.name, self.seed, hidden, self.builtin, self.description)

    def check(self, hidden: int) -> None:
        """Raises InputError (a SpeakerError) if this voice cannot serve a model of this hidden size."""
        if self.speaker is None and self.sample is None:
            raise InputError(f"voice {self.name!r} has neither a speaker nor a reference sample")
        if self.speaker is not None:
            spk.decode_speaker(self.speaker, hidden)
        if self.sample is not None:
            spk.decode_prompt(self.sample)
            if self.text is None:
                raise InputError(f"voice {self.name!r} has a reference sample without its transcript")
        if self.text is not None:
            validate_text(self.text, what="the transcript")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InputError(f"voice name {name!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a letter "
                         f"or digit and not all digits (a number names the seed's speaker)")
    return name


def _voice_from_json(name: str, d) -> Voice:
    if not isinstance(d, dict):
        raise VoiceFileError(f"voice {name!r} is not an object")
    unknown = set(d) - FIELDS
    if unknown:
        raise VoiceFileError(f"voice {name!r} has unknown fields {sorted(unknown)}")
    for k in ("speaker", "sample", "text", "description", "mix"):
        if k in d and not isinstance(d[k], str):
            raise VoiceFileError(f"voice {name!r}: {k} must be a string")
    seed = d.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise VoiceFileError(f"voice {name!r}: seed must be an integer")
    return Voice(name, d.get("speaker"), d.get("sample"), d.get("text"), seed, bool(d.get("builtin", False)),
                 d.get("description", ""), d.get("mix"))


def seed_voice(name: str, seed: int, hidden: int, builtin: bool = False, description: str = "") -> Voice:
    """The speaker upstream's `torch.manual_seed(seed); Chat.sample_random_speaker()` gives (speaker.py)."""
    return Voice(name, speaker=spk.sample_random_speaker(seed, hidden), seed=int(seed), builtin=builtin,
                 description=description)


def builtin_voices(hidden: int) -> dict[str, Voice]:
    return {name: seed_voice(name, seed, hidden, builtin=True) for name, seed in BUILTIN_VOICE_SEEDS.items()}


def carried_over(old: Path, hidden: int) -> tuple[dict[str, Voice], list[str]]:
    """The registry a re-export writes: the previous repository's voices.json (`old`) where there is one,
    else the built-ins. Seed voices are made again for this model's hidden size, and so is a stored mix that
    cannot serve it (from its recipe, over the carried voices); a voice that cannot serve this model is dropped,
    said in the notes returned."""
    if not Path(old).is_file():
        return builtin_voices(hidden), []
    try:
        previous = read_voices(old)
    except VoiceFileError as e:
        return builtin_voices(hidden), [f"the previous {VOICES} was not kept: {e}"]
    voices, notes, remix = {}, [], []
    for name, v in previous.items():
        if v.seed is not None and v.sample is None:
            voices[name] = seed_voice(name, v.seed, hidden, v.builtin, v.description)
            continue
        try:
            v.check(hidden)
        except InputError as e:
            if v.mix is not None and v.sample is None:
                remix.append(v)
            else:
                notes.append(f"voice {name!r} dropped: {e}")
            continue
        voices[name] = v

    def resolve(term: str) -> Voice:
        if term in voices:
            return voices[term]
        if SEED_RE.match(term):
            return _seed_voice_cached(int(term), hidden)
        raise InputError(f"VOICE {term!r} is not a voice of the new registry")

    for v in remix:  # after every other voice: a mix's terms are carried first
        try:
            mixed = mix_voice(v.mix, resolve, hidden, v.name)
        except InputError as e:
            notes.append(f"voice {v.name!r} dropped: its mix cannot be made again: {e}")
            continue
        voices[v.name] = Voice(v.name, speaker=mixed.speaker, mix=mixed.mix, builtin=v.builtin,
                               description=v.description)
        notes.append(f"voice {v.name!r} mixed again for this model ({v.mix})")
    if any(v.sample is not None for v in voices.values()):
        notes.append("reference-audio voices keep the codes the previous weights' encoder gave: re-add them after "
                     "a change of weights")
    return voices, notes


def _registry_docs(text: str, path) -> Docs:
    """The voices of a voices.json's text (name -> its JSON object), its format and names checked."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise VoiceFileError(f"{path} cannot be read: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("voices"), dict):
        raise VoiceFileError(f"{path} is not a voice registry of format {FORMAT} ({{\"format\": {FORMAT}, \"voices\": "
                             "{...}})")
    for name in doc["voices"]:
        try:
            check_name(name)
        except InputError as e:
            raise VoiceFileError(f"{path}: {e}") from None
    return doc["voices"]


def read_voices(path: Path) -> dict[str, Voice]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise VoiceFileError(f"{path} cannot be read: {e}") from None
    return {name: _voice_from_json(name, d) for name, d in _registry_docs(text, path).items()}


def write_voices(path: Path, voices: dict[str, Voice]) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    _write_docs(Path(path), {n: voices[n].to_json() for n in voices})


def _render(docs: Docs) -> dict:
    return {"format": FORMAT, "voices": {n: docs[n] for n in sorted(docs)}}


def _write_docs(path: Path, docs: Docs) -> None:
    write_json_atomically(path, _render(docs))


@contextlib.contextmanager
def editing(repo: Path, hidden: int) -> Iterator[dict[str, Voice]]:
    """The registry of `repo` to change in place; written back when the block ends without an error. Edits
    from several processes are serialised by a lock on the repository folder."""
    repo = Path(repo)
    with folder_lock(repo):
        path = repo / VOICES
        voices = read_voices(path) if path.exists() else builtin_voices(hidden)
        yield voices
        write_voices(path, voices)


def initial_docs() -> Docs:
    """What a store never written holds: the built-in voices, each stored as its seed (`Voice.materialized`)."""
    return {name: {"seed": seed, "builtin": True} for name, seed in BUILTIN_VOICE_SEEDS.items()}


class FileVoiceStore(FileStore):
    """A voices.json (the repository's, or `file:///PATH`), edited under the lock `editing` takes."""

    def __init__(self, path: Path):
        super().__init__(path, NAMESPACE, _registry_docs, _render, initial_docs, error=VoiceFileError)


def delete_voice(store: DocumentStore, name: str) -> bool:
    """Removes a voice from a store; False where it held none."""
    return store.delete(name)


def open_voice_store(url: str = "", repo: Path | None = None) -> DocumentStore:
    """The store `url` names (runtime/stores.py); empty: `repo`'s voices.json."""
    url = (url or "").strip()
    if not url:
        if repo is None:
            raise StoreError("no voice store: give voice_store a URL, or the model repository")
        return FileVoiceStore(Path(repo) / VOICES)
    if urlsplit(url).scheme.lower() == "file":
        return FileVoiceStore(file_store_path(url))
    return open_server_store(url, NAMESPACE, initial_docs)


def store_url(repo: Path | None = None, given: str | None = None) -> str:
    """The voice store a command uses: `given` (its --voice-store), else env CHATTTS_VOICE_STORE, else the
    repository's own setting (its manifest's deployment), else empty (the repository's voices.json)."""
    if given:
        return given.strip()
    configured = ""
    if repo is not None and (Path(repo) / MANIFEST).is_file():
        try:
            man = json.loads((Path(repo) / MANIFEST).read_text(encoding="utf-8"))
            configured = str(man.get("deployment", {}).get("voice_store") or "")
        except (OSError, ValueError, AttributeError):
            configured = ""
    return env_or(configured, VOICE_STORE_ENV)


def voices_of(docs: Docs) -> tuple[dict[str, Voice], dict[str, str]]:
    """(voices, why each unreadable one is) of a store's documents, as stored (a seed voice may hold its seed alone)."""
    voices, broken = {}, {}
    for name, d in docs.items():
        try:
            check_name(name)
            voices[name] = _voice_from_json(name, d)
        except (InputError, VoiceFileError) as e:
            broken[name] = str(e)
    return voices, broken


class VoiceRegistry:
    """Resolves VOICE for a model of hidden size `hidden` from a voice store (or `repo`'s voices.json; the built-in
    voices when it has none), read again when its generation changes (stores.Follower); a store that cannot be
    reached keeps the voices last read (logged)."""

    def __init__(self, source: Path | DocumentStore, hidden: int):
        self.store = source if isinstance(source, DocumentStore) else FileVoiceStore(Path(source) / VOICES)
        self.hidden = hidden
        self._follower = Follower(self.store, self._build, "voice registry", empty=({}, {}))
        self._lock = threading.Lock()
        self._mixes_key: Hashable = None
        self._mixes: OrderedDict[str, Voice] = OrderedDict()  # mix expression -> its voice, for this version

    def voices(self) -> dict[str, Voice]:
        return self._load()[0]

    def _build(self, docs: Docs) -> tuple[dict[str, Voice], dict[str, str]]:
        voices, broken = voices_of(docs)
        for name, voice in list(voices.items()):
            try:
                voices[name] = voice = voice.materialized(self.hidden)
                voice.check(self.hidden)
            except InputError as e:
                broken[name] = str(e)
        if broken:
            log.error("voice store %s: unusable voices %s", shown_url(self.store.url), broken)
        return voices, broken

    def _load(self) -> tuple[dict[str, Voice], dict[str, str]]:
        """(voices, why each unusable one is) of the store now, checked once per generation of it."""
        return self._follower.current()[1]

    def resolve(self, name: str) -> Voice:
        """The voice VOICE names (a mix expression: the mix of the voices it names, `mix_voice`); InputError
        (listing the known names) for an unknown one."""
        if voice_mix.is_mix(name):
            return self._resolve_mix(name)
        voices, broken = self._load()
        voice = voices.get(name)
        if voice is None and SEED_RE.match(name or ""):
            return _seed_voice_cached(int(name), self.hidden)
        if voice is None:
            names = sorted(voices)
            listed = ", ".join(names[:LISTED_IN_ERRORS]) + (f", … ({len(names) - LISTED_IN_ERRORS} more)"
                                                             if len(names) > LISTED_IN_ERRORS else "")
            raise InputError(f"VOICE {name!r} is not a voice of this server; known: {listed or '(none)'}, "
                             f"or a seed number (e.g. 2222)")
        if name in broken:
            raise InputError(f"VOICE {name!r} cannot be used with this model: {broken[name]}")
        return voice

    def _resolve_mix(self, expr: str) -> Voice:
        key = self._follower.current()[0]
        with self._lock:
            if key != self._mixes_key:  # made from another version of the store
                self._mixes.clear()
                self._mixes_key = key
            hit = self._mixes.get(expr)
        if hit is not None:
            return hit
        voice = mix_voice(expr, self.resolve, self.hidden)
        with self._lock:
            if self._mixes_key == key:  # not made from a registry that changed meanwhile
                self._mixes[expr] = voice
                while len(self._mixes) > MIXES_CACHED:
                    self._mixes.popitem(last=False)
        return voice


MIXES_CACHED = 256  # mixes a registry keeps made (each costs its terms' decoding and one LZMA encoding)


def mix_voice(expr: str, resolve: Callable[[str], Voice], hidden: int, name: str | None = None) -> Voice:
    """The voice a mix expression makes (model/mix.py: grammar and rule): its terms resolved by `resolve` (a
    registry's), each a speaker embedding (a seed, a speaker string or a stored mix; a voice of reference audio has
    none to mix); InputError starting with VOICE for every fault, naming the term."""
    shown = voice_mix.shown(expr)
    try:
        terms = voice_mix.parse(expr)
    except voice_mix.MixError as e:
        raise InputError(f"VOICE {shown}: {e}") from None
    embeddings = []
    for term, _ in terms:
        voice = resolve(term)
        if voice.speaker is None or voice.sample is not None:
            raise InputError(f"VOICE {shown}: {term!r} is a voice of reference audio; a mix is made of speaker "
                             f"embeddings only (seed numbers, speaker strings, other mixes)")
        embeddings.append(spk.decode_speaker(voice.speaker, hidden))
    try:
        mixed = voice_mix.mix(embeddings, [w for _, w in terms], hidden)
    except voice_mix.MixError as e:
        raise InputError(f"VOICE {shown}: {e}") from None
    return Voice(name or expr, speaker=spk.encode_speaker(mixed), mix=voice_mix.canonical(terms))


@functools.lru_cache(maxsize=256)
def _seed_voice_cached(seed: int, hidden: int) -> Voice:
    try:
        return seed_voice(str(seed), seed, hidden)
    except InputError as e:
        raise InputError(f"VOICE {seed}: {e}") from None


# --- command line ------------------------------------------------------------------------------------
def _hidden(repo: Path) -> int:
    path = repo / MANIFEST
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: --repo must be an exported repository (make export)")
    return int(json.loads(path.read_text(encoding="utf-8"))["arch"]["gpt"]["hidden"])


# The containers a reference recording may come in (FFmpeg demuxer names): what recorders, browsers and audio
# tools write. Anything else FFmpeg's probe takes a file for (images, video-only, playlists, text) is refused.
REFERENCE_CONTAINERS = frozenset({"wav", "w64", "mp3", "flac", "ogg", "matroska", "webm", "mov", "mp4", "m4a", "aac",
                                  "aiff", "caf", "au", "wv"})


def decode_reference_audio(source, what: str = "reference audio",
                           max_seconds: float = LIMITS.max_reference_audio_seconds):
    """Mono float32 samples at the model's rate (PyAV: resampled by FFmpeg's swresample, channels mixed) of a
    recording in a common container (`REFERENCE_CONTAINERS`): a path or a binary file object. InputError naming
    `what` for anything else, for no audio stream, and for audio longer than `max_seconds` (decoding stops there:
    a small file that expands to hours costs no more than `max_seconds` of it). RuntimeError without PyAV."""
    import numpy as np

    try:
        import av
    except ImportError:
        raise RuntimeError("reading reference audio needs PyAV: pip install 'chattts-triton[gateway]'") from None
    limit = int(max_seconds * SAMPLE_RATE)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    out, n = [], 0
    try:
        with av.open(source if not isinstance(source, Path) else str(source), mode="r") as f:
            kind = set(f.format.name.split(","))
            if not kind & REFERENCE_CONTAINERS:
                raise InputError(f"{what} is {f.format.long_name or f.format.name}, not a recording in a common audio "
                                 f"format (wav, mp3, flac, ogg/opus, webm, m4a/aac, aiff, caf)")
            if not f.streams.audio:
                raise InputError(f"{what} holds no audio stream")
            for frame in f.decode(audio=0):
                for r in resampler.resample(frame):
                    out.append(r.to_ndarray().reshape(-1))
                    n += out[-1].size
                if n > limit:
                    break
            else:
                out += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
                n = sum(a.size for a in out)
    except InputError:
        raise
    except (av.FFmpegError, OSError, IndexError, ValueError, EOFError) as e:
        raise InputError(f"{what} is not readable audio ({type(e).__name__}: {str(e)[:200]})") from None
    if n > limit:
        raise InputError(f"{what} is longer than {max_seconds:g} s")
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def read_reference_audio(path: Path):
    """`decode_reference_audio` of a file, for the command line (SystemExit with the reason)."""
    try:
        return decode_reference_audio(Path(path), what=str(path))
    except (InputError, RuntimeError) as e:
        raise SystemExit(f"error: {e}") from None


def encode_reference(repo: Path, wav) -> str:
    """The spk_smp string of reference audio, encoded by the repository's DVAE encoder as the server does."""
    import torch

    from .artifacts import Artifact, check_reference_audio, reference_codes

    check_reference_audio(wav)
    encoder = Artifact(repo / PREPROCESS / "1" / "dvae_encode", "torchscript", torch.device("cpu"))
    return spk.encode_prompt(reference_codes(encoder, wav))


def _text_arg(value: str | None) -> str | None:
    if value is not None and value.startswith("@"):
        return Path(value[1:]).read_text(encoding="utf-8").strip()
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chattts_triton.voices",
                                 description="List, add and remove the named voices of a model repository "
                                             "(REPO/voices.json).")
    ap.add_argument("--repo", type=Path, required=True, help="an exported model repository")
    ap.add_argument("--voice-store", metavar="URL", default=None,
                    help="the voice store (sqlite:///PATH, redis://..., postgresql://...; docs/voices.md); default: "
                         "env "
                         f"{VOICE_STORE_ENV}, else the repository's voice_store setting, else REPO/{VOICES}")
    sub = ap.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="the voices and what each is made of")
    ls.add_argument("--json", action="store_true", help="voices.json's content")
    add = sub.add_parser("add", help="add (or with --force replace) a voice")
    add.add_argument("name")
    src = add.add_mutually_exclusive_group(required=True)
    src.add_argument("--seed", type=int, help="the speaker torch.manual_seed(SEED); Chat.sample_random_speaker() gives")
    src.add_argument("--speaker", metavar="STR", help="a speaker string (Chat.sample_random_speaker()); @FILE reads it")
    src.add_argument("--audio", type=Path, metavar="FILE",
                     help=f"reference audio (any format FFmpeg reads, ≤ {LIMITS.max_reference_audio_seconds:g} s), "
                          "with --text")
    src.add_argument("--sample", metavar="STR", help="a reference sample string (Chat.sample_audio_speaker()), with "
                                                     "--text; @FILE reads it")
    src.add_argument("--mix", metavar="EXPR", help="a mix of this repository's voices and seeds: '2222*0.7+nova*0.3' "
                     "or '2222(2)+nova(1)' (docs/gateway.md#voice-mixes)")
    add.add_argument("--text", help="what the reference audio says (its transcript); @FILE reads it")
    add.add_argument("--description", default="")
    add.add_argument("--force", action="store_true", help="replace a voice of that name")
    rm = sub.add_parser("remove", help="remove a voice (built-in ones too)")
    rm.add_argument("name")
    a = ap.parse_args(argv)

    repo = a.repo
    hidden = _hidden(repo)
    try:
        store = open_voice_store(store_url(repo, a.voice_store), repo)
        if a.command == "list":
            voices, broken = voices_of(store.snapshot()[1])
            for _, why in sorted(broken.items()):
                print(f"error: {why}", file=sys.stderr)
            if a.json:
                print(json.dumps({n: voices[n].to_json() for n in sorted(voices)}, indent=2, ensure_ascii=False))
            for name in ([] if a.json else sorted(voices)):
                v = voices[name]
                extra = (" (built-in)" if v.builtin else "") + (f": {v.description}" if v.description else "")
                print(f"{name}\t{v.source}{extra}")
            return 0
        check_name(a.name)
        if a.command == "add":
            text = _text_arg(a.text)
            if (a.audio is not None or a.sample is not None) != (text is not None):
                ap.error("--text goes with --audio or --sample (the transcript of the reference), and they need it")
            if a.seed is not None:
                voice = seed_voice(a.name, a.seed, hidden, description=a.description)
            elif a.speaker is not None:
                voice = Voice(a.name, speaker=_text_arg(a.speaker), description=a.description)
            elif a.mix is not None:
                mixed = mix_voice(a.mix, VoiceRegistry(store, hidden).resolve, hidden, a.name)
                voice = Voice(a.name, speaker=mixed.speaker, mix=mixed.mix, description=a.description)
            else:
                sample = (_text_arg(a.sample) if a.sample is not None
                          else encode_reference(repo, read_reference_audio(a.audio)))
                voice = Voice(a.name, sample=sample, text=text, description=a.description)
            voice.check(hidden)
            try:
                store.put(a.name, voice.to_json(), replace=a.force)
            except Exists:
                raise InputError(f"voice {a.name!r} exists; --force replaces it") from None
            print(f"added {a.name}: {voice.source}")
        else:
            if not delete_voice(store, a.name):
                raise InputError(f"no voice {a.name!r} (known: {', '.join(sorted(store.snapshot()[1])) or 'none'})")
            print(f"removed {a.name}")
    except (InputError, StoreError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
