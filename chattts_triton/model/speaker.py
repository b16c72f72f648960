"""Speaker strings of ChatTTS 0.2.5 (`ChatTTS.model.speaker.Speaker`), without the ChatTTS package.

Two kinds of client-supplied speaker strings exist upstream:
- a speaker embedding (`spk_emb`): base16384(raw LZMA2(fp16[hidden])), see `decode_speaker`;
- a reference-audio prompt (`spk_smp`): base16384(uint16le shape[2] + raw LZMA2(uint16le codes)),
  see `decode_prompt`.
Decoding never trusts the input: bad base16384, bad or oversized LZMA data, wrong sizes and
non-finite values raise `SpeakerError` (an `InputError`, so a ValueError) with a readable message.
Parity with upstream: tests/test_speaker.py.
"""

from __future__ import annotations

import functools
import lzma
import math

import numpy as np
import pybase16384 as b14
import torch
import torch.nn.functional as F

from ..config import FULL_ARCH, LIMITS, NUM_AUDIO_TOKENS, NUM_VQ, SAMPLE_RATE, SAMPLES_PER_CODE
from .spk_stat import SPK_STAT
from .text import InputError

HIDDEN = FULL_ARCH.gpt.hidden  # speakers of the real model have this many fp16 values
# Longest reference prompt accepted: the reference-audio limit in code frames (+1 for rounding).
MAX_PROMPT_CODES = math.ceil(LIMITS.max_reference_audio_seconds * SAMPLE_RATE / SAMPLES_PER_CODE) + 1

_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
_B14_FIRST, _B14_LAST = 0x4E00, 0x8DFF  # base16384 alphabet
_B14_TAIL = range(0x3D01, 0x3D07)  # final marker: number of bytes in the last partial group


class SpeakerError(InputError):
    """A speaker or reference-prompt string that cannot be decoded for this model."""


# --- shared codec pieces --------------------------------------------------------------------------
def _b14_decode(s, what: str, max_bytes: int) -> bytes:
    if not isinstance(s, str):
        raise SpeakerError(f"{what} must be a string, got {type(s).__name__}")
    s = s.strip()  # whitespace is never part of base16384, a trailing newline is a common slip
    if not s:
        raise SpeakerError(f"{what} is empty")
    # 4 characters carry 7 bytes; the bound keeps garbage from costing real work.
    if len(s) > (max_bytes * 4) // 7 + 8:
        raise SpeakerError(f"{what} is too long ({len(s)} characters) to be valid for this model")
    for i, c in enumerate(s):
        o = ord(c)
        if not (_B14_FIRST <= o <= _B14_LAST or (o in _B14_TAIL and i == len(s) - 1)):
            raise SpeakerError(
                f"{what} is not base16384: character {i} is U+{o:04X}; pass the string exactly as it "
                f"was produced (e.g. by Chat.sample_random_speaker)"
            )
    try:
        data = b14.decode_from_string(s)
        canonical = b14.encode_to_string(data) == s
    except Exception as e:  # noqa: BLE001  pybase16384 raises SystemError on some malformed tails
        raise SpeakerError(f"{what} is not valid base16384 ({e})") from None
    if not canonical:
        raise SpeakerError(f"{what} is not valid base16384 (truncated or altered)")
    return data


def _lzma_decompress(data: bytes, max_bytes: int, what: str) -> bytes:
    # Same result as upstream's lzma.decompress(FORMAT_RAW) (incl. concatenated streams and ignored
    # trailing garbage), but stops once the output exceeds what a valid value can be.
    out, total = [], 0
    while True:
        dec = lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
        try:
            chunk = dec.decompress(data, max_length=max_bytes - total + 1)
        except lzma.LZMAError as e:
            if out:
                break
            raise SpeakerError(f"{what} is corrupt: its LZMA data does not decompress ({e})") from None
        out.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise SpeakerError(
                f"{what} decompresses to more than {max_bytes} bytes; it is not for this model"
            )
        if not dec.eof:
            raise SpeakerError(f"{what} is truncated: its LZMA data ends early")
        data = dec.unused_data
        if not data:
            break
    return b"".join(out)


def _lzma_compress(raw: bytes) -> bytes:
    return lzma.compress(raw, format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)


# --- speaker embedding (spk_emb) ------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def spk_stat() -> tuple[torch.Tensor, torch.Tensor]:
    """(std, mean), fp16 [768] each, as upstream `Speaker.__init__` reads `Config.spk_stat`."""
    stat = torch.from_numpy(np.frombuffer(b14.decode_from_string(SPK_STAT), dtype=np.float16).copy())
    std, mean = stat.chunk(2)
    return std, mean


def decode_speaker(spk: str, hidden: int = HIDDEN) -> np.ndarray:
    """Upstream `Speaker._decode`: fp16 [hidden], checked to fit the model and be finite."""
    what = "speaker"
    # Room for a full-size speaker even on tiny weights, so the size error below names both sizes.
    cap = 2 * max(hidden, HIDDEN)
    data = _lzma_decompress(_b14_decode(spk, what, max_bytes=cap + 64), cap, what)
    if len(data) != 2 * hidden:
        got = f"{len(data) // 2} values" if len(data) % 2 == 0 else f"{len(data)} bytes"
        raise SpeakerError(f"{what} has {got}; this model needs {hidden} (hidden size)")
    arr = np.frombuffer(data, dtype=np.float16).copy()
    if not np.isfinite(arr).all():
        raise SpeakerError(f"{what} contains NaN or infinite values")
    return arr


def encode_speaker(emb: torch.Tensor | np.ndarray) -> str:
    """Upstream `Speaker._encode`: any 1-D float vector -> speaker string (stored as fp16)."""
    if isinstance(emb, torch.Tensor):
        arr = emb.detach().to(dtype=torch.float16, device="cpu").numpy()
    else:
        arr = np.asarray(emb, dtype=np.float16)
    if arr.ndim != 1 or arr.size == 0:
        raise SpeakerError(f"a speaker embedding must be a non-empty 1-D vector, got {list(arr.shape)}")
    return b14.encode_to_string(_lzma_compress(arr.tobytes()))


def sample_random_speaker(seed: int, hidden: int = HIDDEN) -> str:
    """Upstream `torch.manual_seed(seed); Speaker.sample_random()`, without touching global RNG state.

    For hidden < 768 (tiny test weights only) the first `hidden` entries of std/mean are used; upstream
    has no such mode, real ChatTTS always has 768.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise SpeakerError(f"seed must be an integer, got {type(seed).__name__}")
    std, mean = spk_stat()
    if not 0 < hidden <= std.numel():
        raise SpeakerError(f"hidden size {hidden} is not in 1..{std.numel()} (the size of spk_stat)")
    try:
        gen = torch.Generator().manual_seed(int(seed))
    except (RuntimeError, OverflowError, ValueError) as e:
        raise SpeakerError(f"seed {seed} is out of range ({e})") from None
    spk = torch.randn(hidden, generator=gen, dtype=std.dtype).mul_(std[:hidden]).add_(mean[:hidden])
    return encode_speaker(spk)


def speaker_embedding(
    spk: str, hidden: int = HIDDEN, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[hidden]: the vector upstream `Speaker.apply` writes at each [spk_emb] position.

    Upstream L2-normalizes the decoded fp16 vector in fp16 (on the embedding's device; this is the CPU
    result), then the write into the fp32 embedding upcasts it exactly.
    """
    vec = torch.from_numpy(decode_speaker(spk, hidden))
    normed = F.normalize(vec, p=2.0, dim=0, eps=1e-12)
    if not torch.isfinite(normed).all() or not normed.any():
        raise SpeakerError("speaker has zero or overflowing norm; it cannot be normalized")
    return normed.to(dtype)


# --- reference-audio prompt (spk_smp) -------------------------------------------------------------
def encode_prompt(codes: torch.Tensor | np.ndarray) -> str:
    """Upstream `Speaker.encode_prompt`: audio codes [NUM_VQ, T] -> prompt string."""
    arr = codes.detach().cpu().numpy() if isinstance(codes, torch.Tensor) else np.asarray(codes)
    if arr.ndim != 2 or arr.shape[0] != NUM_VQ or arr.shape[1] == 0:
        raise SpeakerError(f"reference codes must have shape [{NUM_VQ}, T>0], got {list(arr.shape)}")
    if arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= NUM_AUDIO_TOKENS:
        raise SpeakerError(f"reference codes must be integers in [0, {NUM_AUDIO_TOKENS})")
    arr = arr.astype("<u2")
    header = np.array(arr.shape, dtype="<u2").tobytes()
    return b14.encode_to_string(header + _lzma_compress(arr.tobytes()))


def decode_prompt(prompt: str, max_codes: int = MAX_PROMPT_CODES) -> np.ndarray:
    """Upstream `Speaker.decode_prompt`: prompt string -> int64 codes [NUM_VQ, T] (upstream: int32
    tensor, same values), checked: NUM_VQ rows, 1 <= T <= max_codes, codes < NUM_AUDIO_TOKENS."""
    what = "reference speaker prompt"
    max_raw = 2 * NUM_VQ * max_codes
    data = _b14_decode(prompt, what, max_bytes=4 + max_raw + max_raw // 1000 + 64)
    if len(data) < 4:
        raise SpeakerError(f"{what} is too short to hold its shape header")
    rows, cols = (int(x) for x in np.frombuffer(data[:4], dtype="<u2"))
    if rows != NUM_VQ or not 1 <= cols <= max_codes:
        raise SpeakerError(f"{what} has shape [{rows}, {cols}]; expected [{NUM_VQ}, 1..{max_codes}]")
    raw = _lzma_decompress(data[4:], 2 * rows * cols, what)
    if len(raw) != 2 * rows * cols:
        raise SpeakerError(f"{what} holds {len(raw)} bytes of codes; its header says [{rows}, {cols}]")
    codes = np.frombuffer(raw, dtype="<u2").astype(np.int64).reshape(rows, cols)
    if codes.max() >= NUM_AUDIO_TOKENS:
        raise SpeakerError(f"{what} contains code {codes.max()}; codes must be < {NUM_AUDIO_TOKENS}")
    return codes
