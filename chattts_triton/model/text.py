"""Serving-side text path of ChatTTS 0.2.5, without ChatTTS/transformers/numba.

- `Normalizer`: port of `ChatTTS.norm.Normalizer.__call__`; with `spoken=` (the server's), the spoken-form step
  (chattts_triton.model.spoken) runs where upstream runs its registered language normalisers.
- `split_text`: the split `Chat.infer` applies to a str input.
- `TextTokenizer`: `ChatTTS.model.tokenizer.Tokenizer` on top of the `tokenizers` library.
- `build_code_prompt` / `build_refine_prompt` / `refined_text`: what upstream feeds the GPT for ONE text
  (`Speaker.decorate_*_prompts` + `Tokenizer.encode`) and how it turns refined ids back into text.
- `validate_text` / `validate_prompt`: reject client input that upstream would mangle or crash on.

Every function here is proven equal to upstream by tests/test_text.py (the Normalizer with the spoken-form
step equal to upstream's with the same step registered).
"""

from __future__ import annotations

import gzip
import json
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import (
    LIMITS,
    NUM_AUDIO_TOKENS,
    NUM_VQ,
    REFINE_KEEP_BELOW_TOKEN,
    SPECIAL_TOKENS,
    SPK_EMB_TOKEN,
    TEXT_EOS_TOKEN,
)
from .assets import AssetError


class InputError(ValueError):
    """Client input that cannot be served; the message is meant for the client."""


# Structural tokens upstream wraps prompts with (Speaker.decorate_*_prompts). Clients must not send them.
STTS_TOKEN = "[Stts]"
PTTS_TOKEN = "[Ptts]"
EMPTY_SPK_TOKEN = "[empty_spk]"
SBREAK_TOKEN = "[Sbreak]"
PBREAK_TOKEN = "[Pbreak]"
RESERVED_TOKENS = frozenset(
    [SBREAK_TOKEN, PBREAK_TOKEN, TEXT_EOS_TOKEN, STTS_TOKEN, PTTS_TOKEN, SPK_EMB_TOKEN, EMPTY_SPK_TOKEN]
)
# Control tokens a client may use inside TEXT and PROMPT: [uv_break], [laugh_1], [speed_5], ...
USER_TOKENS = frozenset(t for t in SPECIAL_TOKENS if t not in RESERVED_TOKENS)
assert RESERVED_TOKENS <= set(SPECIAL_TOKENS)

MAX_PROMPT_CHARS = 256  # a PROMPT is a few control tokens; anything longer is a client bug

HOMOPHONES_PATH = Path(__file__).with_name("res") / "homophones_map.json.gz"


# ================================================================================================
# Normalizer
# ================================================================================================
_REJECT = re.compile(r"[^\u4e00-\u9fffA-Za-z，。、,\. ]")
TAG_RE = _TAG = re.compile(r"\[[\w_]+\]")
_CHINESE_CHAR = re.compile(r"[\u4e00-\u9fff]")
_ENGLISH_WORD = re.compile(r"\b[A-Za-z]+\b")
_SURROGATE = re.compile(r"[\ud800-\udfff]")

_CHARACTER_SIMPLIFIER = str.maketrans(
    {
        "：": "，", "；": "，", "！": "。", "（": "，", "）": "，", "【": "，", "】": "，",
        "『": "，", "』": "，", "「": "，", "」": "，", "《": "，", "》": "，", "－": "，",
        ":": ",", ";": ",", "!": ".", "(": ",", ")": ",", ">": ",", "<": ",", "-": ",",
    }
)  # fmt: skip
_HALF_TO_FULL = str.maketrans(
    {
        "!": "！", '"': "“", "'": "‘", "#": "＃", "$": "＄", "%": "％", "&": "＆", "(": "（",
        ")": "）", ",": "，", "-": "－", "*": "＊", "+": "＋", ".": "。", "/": "／", ":": "：",
        ";": "；", "<": "＜", "=": "＝", ">": "＞", "?": "？", "@": "＠", "\\": "＼", "^": "＾",
        "`": "｀", "{": "｛", "|": "｜", "}": "｝", "~": "～",
    }
)  # fmt: skip


def _split_tags(text: str) -> tuple[list[str], list[str]]:
    # Literal port of upstream's numba `_split_tags`, quirks included: an unclosed "[..." is dropped
    # and a stray "]" yields an empty tag.
    texts: list[str] = []
    tags: list[str] = []
    current_text = ""
    current_tag = ""
    for c in text:
        if c == "[":
            texts.append(current_text)
            current_text = ""
            current_tag = c
        elif current_tag != "":
            current_tag += c
        else:
            current_text += c
        if c == "]":
            tags.append(current_tag)
            current_tag = ""
    if current_text != "":
        texts.append(current_text)
    return texts, tags


def _combine_tags(texts: list[str], tags: list[str]) -> str:
    out = []
    for i, t in enumerate(texts):
        out.append(t)
        if i < len(tags):
            out.append(tags[i])
    return "".join(out)


def _load_homophones(path: Path) -> dict:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            mapping = json.load(f)
    except (OSError, ValueError) as e:
        raise AssetError(f"cannot read homophones map {path}: {e}") from e
    return {ord(k): v for k, v in mapping.items()}


@dataclass(frozen=True)
class Normalized:
    """A normalised text and what the upstream step removed from it (outside control tokens): character -> count.
    Nothing else is removed: the spoken-form step rewrites, the upstream step maps punctuation and homophones."""

    text: str
    removed: dict[str, int] = field(default_factory=dict)


class Normalizer:
    """`ChatTTS.norm.Normalizer` as `Chat` uses it. `spoken(text, lang) -> text`: the language normaliser upstream
    would have registered (`chat.normalizer.register(lang, fn)`), applied to the text between control tokens first;
    None: none registered, as in a plain `Chat`."""

    def __init__(self, homophones_path: str | Path = HOMOPHONES_PATH,
                 spoken: Callable[[str, str], str] | None = None):
        # Upstream replaces each UTF-16 unit once via table lookup; all keys and values are BMP, so a
        # single-pass str.translate is the same mapping.
        self._homophones = _load_homophones(Path(homophones_path))
        self.spoken = spoken

    def __call__(
        self,
        text: str,
        do_text_normalization: bool = True,
        do_homophone_replacement: bool = True,
        lang: str | None = None,
    ) -> str:
        return self.normalize(text, do_text_normalization, do_homophone_replacement, lang).text

    def normalize(
        self,
        text: str,
        do_text_normalization: bool = True,
        do_homophone_replacement: bool = True,
        lang: str | None = None,
    ) -> Normalized:
        """`__call__`, also telling which characters were removed."""
        if lang not in (None, "zh", "en"):
            raise InputError(f"unsupported language {lang!r}; use 'zh', 'en' or leave it unset")
        if do_text_normalization:
            lang = detect_language(text) if lang is None else lang
            if self.spoken is not None:
                texts, tags = _split_tags(text)
                texts = [self.spoken(t, lang) for t in texts]
                text = _combine_tags(texts, tags) if tags else (texts[0] if texts else "")
            if lang == "zh":
                text = text.translate(_HALF_TO_FULL)
        invalid = self.invalid_characters(text)
        if invalid:
            text = text.translate(_CHARACTER_SIMPLIFIER)
        if do_homophone_replacement:
            if _SURROGATE.search(text):  # upstream's UTF-16 encode fails on these
                raise InputError("text contains an unpaired UTF-16 surrogate")
            text = text.translate(self._homophones)
        removed: Counter = Counter()
        if invalid:
            texts, tags = _split_tags(text)
            for t in texts:
                removed.update(_REJECT.findall(t))
            texts = [_REJECT.sub("", t) for t in texts]
            text = _combine_tags(texts, tags) if tags else texts[0]
        return Normalized(text, dict(removed))

    @staticmethod
    def invalid_characters(text: str) -> set:
        """Characters upstream removes (outside tags): not CJK, ASCII letters, space or ，。、,."""
        return set(_REJECT.findall(_TAG.sub("", text)))


def describe_characters(counts: dict[str, int], most: int = 10) -> str:
    """"'😀' U+1F600 (GRINNING FACE) ×2, '%' U+0025 (PERCENT SIGN)": the most frequent first, at most `most`."""
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{ch!r} {_describe(ch)}" + (f" ×{n}" if n > 1 else "") for ch, n in items[:most]]
    if len(items) > most:
        parts.append(f"and {len(items) - most} more")
    return ", ".join(parts)


def detect_language(text: str) -> str:
    """Upstream rule: "zh" when there are more CJK characters than English words, else "en"."""
    return "zh" if len(_CHINESE_CHAR.findall(text)) > len(_ENGLISH_WORD.findall(text)) else "en"


def split_text(text: str, drop_empty: bool = False) -> list[str]:
    """Upstream `Chat.infer(split_text=True)` split: on newlines if any, else after "。" and ". ".

    Upstream keeps empty pieces of the newline split (and synthesizes them); `drop_empty=True` removes
    whitespace-only pieces from either split. Kept equal to upstream; what clients send is
    `chattts_triton.model.split.split_for_synthesis`, which also cuts sentences too long to be spoken whole.
    """
    if "\n" in text:
        parts = text.split("\n")
    else:
        parts = [p for p in re.split(r"(?<=。)|(?<=\.\s)", text) if p]
    if drop_empty:
        parts = [p for p in parts if p.strip()]
    return parts


# ================================================================================================
# Tokenizer
# ================================================================================================
def _clean_up_tokenization(text: str) -> str:
    # transformers' PreTrainedTokenizerBase.clean_up_tokenization
    return (
        text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
        .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
        .replace(" 've", "'ve").replace(" 're", "'re")
    )  # fmt: skip


class TextTokenizer:
    """`ChatTTS.model.tokenizer.Tokenizer` over `tokenizer.json` (a file or its folder)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = folder / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise AssetError(f"missing asset file {file}")
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise AssetError(f"corrupt asset file {file}: {e}") from e
        # transformers encodes without truncation/padding for a single text, whatever the file says.
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        self._clean_up = self._read_clean_up_flag(folder / "tokenizer_config.json")

        missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
        if missing:
            raise AssetError(f"tokenizer {file} lacks special tokens: {', '.join(missing)}")
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)  # upstream Tokenizer.len
        self.spk_emb_id: int = tok.token_to_id(SPK_EMB_TOKEN)  # upstream spk_emb_ids
        self.break_0_id: int = tok.token_to_id(REFINE_KEEP_BELOW_TOKEN)  # upstream break_0_ids
        self.eos_id: int = tok.token_to_id(TEXT_EOS_TOKEN)  # upstream eos_token

    @staticmethod
    def _read_clean_up_flag(config_file: Path) -> bool:
        # transformers 5 applies clean_up_tokenization on decode only when the config asks for it.
        if not config_file.is_file():
            return False
        try:
            cfg = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise AssetError(f"corrupt asset file {config_file}: {e}") from e
        return bool(cfg.get("clean_up_tokenization_spaces", False))

    def __len__(self) -> int:
        return self.vocab_size

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return i

    def encode(self, text: str) -> list[int]:
        """Ids without [CLS]/[SEP], as upstream `encode_plus(add_special_tokens=False)`."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Upstream `Tokenizer.decode` of one sequence (special tokens kept)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        text = self._tok.decode(ids, skip_special_tokens=False)
        return _clean_up_tokenization(text) if self._clean_up else text


# ================================================================================================
# Prompts
# ================================================================================================
@dataclass(frozen=True)
class CodePrompt:
    """The GPT input of one infer-code request, as upstream `Tokenizer.encode` lays it out:
    text tokens first, then the reference-speaker audio codes (if any)."""

    text_ids: np.ndarray  # int64 [N]
    audio_codes: np.ndarray  # int64 [P, NUM_VQ]; P == 0 without a reference speaker
    spk_emb_positions: np.ndarray  # int64 [k]: where the speaker embedding replaces the token embedding

    @property
    def length(self) -> int:
        return int(self.text_ids.shape[0] + self.audio_codes.shape[0])

    def input_ids(self) -> np.ndarray:
        """int64 [N+P, NUM_VQ], equal to upstream `input_ids[0]` for a batch of one."""
        text = np.repeat(self.text_ids[:, None], NUM_VQ, axis=1)
        return np.concatenate([text, self.audio_codes], axis=0)

    def text_mask(self) -> np.ndarray:
        """bool [N+P]: True on text positions (upstream `text_mask[0]`)."""
        return np.arange(self.length) < self.text_ids.shape[0]


def decorate_code_text(
    text: str, prompt: str = "[speed_5]", txt_smp: str | None = None, spk_emb: bool = False
) -> str:
    """Upstream `Speaker.decorate_code_prompts` for one text."""
    text = text.replace(STTS_TOKEN, "").replace(SPK_EMB_TOKEN, "").replace(EMPTY_SPK_TOKEN, "").strip()
    if prompt:
        text = prompt + text
    speaker = SPK_EMB_TOKEN if spk_emb else EMPTY_SPK_TOKEN
    return f"{STTS_TOKEN}{speaker}{txt_smp or ''}{text}{PTTS_TOKEN}"


def decorate_refine_text(text: str, prompt: str = "") -> str:
    """Upstream `Speaker.decorate_text_prompts` for one text."""
    return f"{SBREAK_TOKEN}{text}{PBREAK_TOKEN}{prompt}"


def check_audio_codes(codes, what: str = "reference speaker codes") -> np.ndarray:
    """[NUM_VQ, T] audio codes (as `speaker.decode_prompt` returns) -> int64 [T, NUM_VQ]."""
    arr = np.asarray(codes.cpu() if hasattr(codes, "cpu") else codes)
    if arr.ndim != 2 or arr.shape[0] != NUM_VQ:
        raise InputError(f"{what} must have shape [{NUM_VQ}, T], got {list(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise InputError(f"{what} must be integers, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= NUM_AUDIO_TOKENS):
        raise InputError(f"{what} must lie in [0, {NUM_AUDIO_TOKENS}), got {arr.min()}..{arr.max()}")
    return np.ascontiguousarray(arr.T, dtype=np.int64)


def build_code_prompt(
    tokenizer: TextTokenizer,
    text: str,
    prompt: str = "[speed_5]",
    spk_emb: bool = False,
    txt_smp: str | None = None,
    spk_smp_codes=None,
    max_tokens: int | None = None,
) -> CodePrompt:
    """Upstream `tokenizer.encode(speaker.decorate_code_prompts([text], prompt, txt_smp, spk_emb),
    NUM_VQ, prompt=spk_smp_codes)` for one text, without batch padding.

    `spk_emb`: whether a speaker embedding will be applied (upstream passes the string; only its
    presence matters here). `spk_smp_codes`: [NUM_VQ, T] reference codes (`speaker.decode_prompt`).
    """
    text_ids = np.asarray(tokenizer.encode(decorate_code_text(text, prompt, txt_smp, spk_emb)), np.int64)
    if spk_smp_codes is None:
        audio_codes = np.zeros((0, NUM_VQ), np.int64)
    else:
        audio_codes = check_audio_codes(spk_smp_codes)
    # Upstream replaces every position whose first column is the [spk_emb] id (text or audio).
    if spk_emb:
        first_col = np.concatenate([text_ids, audio_codes[:, 0]])
        positions = np.flatnonzero(first_col == tokenizer.spk_emb_id).astype(np.int64)
    else:
        positions = np.zeros(0, np.int64)
    out = CodePrompt(text_ids, audio_codes, positions)
    if max_tokens is not None and out.length > max_tokens:
        raise InputError(
            f"the prompt is {out.length} tokens ({len(text_ids)} text + {len(audio_codes)} reference "
            f"audio), more than the limit of {max_tokens}; shorten the text or the reference audio"
        )
    return out


def build_refine_prompt(tokenizer: TextTokenizer, text: str, prompt: str = "") -> np.ndarray:
    """int64 [N]: upstream refine-text input ids (`decorate_text_prompts` + `encode`) for one text."""
    return np.asarray(tokenizer.encode(decorate_refine_text(text, prompt)), np.int64)


def refined_text(tokenizer: TextTokenizer, ids: Sequence[int]) -> str:
    """Upstream `Chat._infer`: keep refined ids below [break_0], decode them to the new text."""
    return tokenizer.decode([int(i) for i in ids if int(i) < tokenizer.break_0_id])


# ================================================================================================
# Validation
# ================================================================================================
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
_BRACKET_TOKEN = re.compile(r"\[[^\[\]]*\]")


def _allowed_tokens_summary() -> str:
    groups: dict = {}
    for t in SPECIAL_TOKENS:
        if t in USER_TOKENS:
            stem, _, n = t[1:-1].rpartition("_")
            key = stem if n.isdigit() else t[1:-1]
            groups.setdefault(key, []).append(n if n.isdigit() else None)
    parts = []
    for key, ns in groups.items():
        if ns == [None]:
            parts.append(f"[{key}]")
        else:
            parts.append(f"[{key}_{min(ns, key=int)}..{max(ns, key=int)}]")
    return ", ".join(parts)


ALLOWED_TOKENS_HELP = _allowed_tokens_summary()


def _as_str(value, what: str) -> str:
    if isinstance(value, np.bytes_):
        value = bytes(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{what} is not valid UTF-8 (bad byte at offset {e.start})") from None
    if isinstance(value, str):
        return value
    raise InputError(f"{what} must be a string, got {type(value).__name__}")


def _describe(ch: str) -> str:
    return f"U+{ord(ch):04X}" + (f" ({unicodedata.name(ch)})" if unicodedata.name(ch, "") else "")


def _check_controls(text: str, what: str) -> None:
    m = _CONTROL.search(text)
    if m:
        kind = "an unpaired surrogate" if "\ud800" <= m.group() <= "\udfff" else "a control character"
        raise InputError(f"{what} contains {kind} {_describe(m.group())} at character {m.start()}")


def _check_token(token: str, pos: int, what: str) -> None:
    if token in USER_TOKENS:
        return
    if token in RESERVED_TOKENS:
        raise InputError(
            f"{what} contains the reserved token {token} at character {pos}; the server adds it itself"
        )
    raise InputError(
        f"{what} contains an unknown token {token!r} at character {pos}; allowed: {ALLOWED_TOKENS_HELP}"
    )


def _stray_bracket(text: str, start: int, end: int, what: str) -> None:
    for i in range(start, end):
        if text[i] in "[]":
            raise InputError(
                f"{what} has an unmatched {text[i]!r} at character {i}; square brackets are only for "
                f"control tokens like [uv_break]"
            )


def validate_text(
    text, max_chars: int = LIMITS.max_text_chars, allow_empty: bool = False, what: str = "TEXT"
) -> str:
    """Return `text` as str if it can be served, else raise InputError saying why.

    Rejects: non-strings, invalid UTF-8, empty/whitespace-only (unless allow_empty), more than
    `max_chars` characters, control characters other than tab/newline/CR, unpaired surrogates, and
    square brackets that are not exactly a known control token ([uv_break], [laugh_1], ...).
    """
    if isinstance(text, (bytes, bytearray)) and len(text) > 4 * max_chars:  # UTF-8 is <= 4 bytes/char
        raise InputError(f"{what} is longer than {max_chars} characters")
    text = _as_str(text, what)
    if len(text) > max_chars:
        raise InputError(f"{what} has {len(text)} characters, more than the limit of {max_chars}")
    if not text.strip():
        if allow_empty:
            return text
        raise InputError(f"{what} is empty" if not text else f"{what} contains only whitespace")
    _check_controls(text, what)
    pos = 0
    for m in _BRACKET_TOKEN.finditer(text):
        _stray_bracket(text, pos, m.start(), what)
        _check_token(m.group(), m.start(), what)
        pos = m.end()
    _stray_bracket(text, pos, len(text), what)
    return text


def validate_prompt(prompt, what: str = "PROMPT") -> str:
    """A PROMPT is "" or control tokens back to back, e.g. "[speed_5]" or "[oral_2][laugh_0][break_6]"."""
    prompt = _as_str(prompt, what)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InputError(
            f"{what} has {len(prompt)} characters, more than the limit of {MAX_PROMPT_CHARS}"
        )
    pos = 0
    for m in _BRACKET_TOKEN.finditer(prompt):
        if m.start() != pos:
            break
        _check_token(m.group(), m.start(), what)
        pos = m.end()
    if pos != len(prompt):
        _check_controls(prompt, what)
        raise InputError(
            f"{what} must be control tokens back to back like [speed_5][oral_2], found {prompt[pos]!r} "
            f"at character {pos}; allowed tokens: {ALLOWED_TOKENS_HELP}"
        )
    return prompt
