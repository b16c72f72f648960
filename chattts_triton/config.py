"""One source of truth for shapes, limits, defaults and tensor names.

Everything that the exporter, the core engine, the Triton adapters, the launcher, the client and the tests
need to agree on lives here, with no dependency beyond the standard library (the client imports it). Values
that mirror upstream ChatTTS 0.2.5 are checked against upstream by `tests/test_config.py`.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from dataclasses import dataclass

# --- audio -------------------------------------------------------------------------------------
SAMPLE_RATE = 24000
N_FFT = 1024
HOP_LENGTH = 256
N_MELS = 100
MEL_FRAMES_PER_CODE = 2  # Decoder/DVAE double the time axis
SAMPLES_PER_CODE = MEL_FRAMES_PER_CODE * HOP_LENGTH  # 512 samples ≈ 21.3 ms


def samples_for_codes(n_codes: int) -> int:
    """Waveform length Vocos (center ISTFT) produces for `n_codes` code frames."""
    if n_codes <= 0:
        return 0
    return HOP_LENGTH * (MEL_FRAMES_PER_CODE * n_codes - 1)


# --- tokens ------------------------------------------------------------------------------------
NUM_VQ = 4
NUM_AUDIO_TOKENS = 626
AUDIO_EOS = NUM_AUDIO_TOKENS - 1  # code 625 ends an utterance
NUM_TEXT_TOKENS = 21178
# engine admission while generating: prefill waiting requests together once this many wait, or once
# the oldest has waited this many decode steps (the Engine's defaults, and so the deployment's:
# triton/deployment.py's gpt_admit_batch and gpt_admit_wait_steps name these)
ADMIT_BATCH = 32
ADMIT_WAIT_STEPS = 4
# an engine's admission bound per slot: generations running + waiting (GPT), streams in flight (stream model)
PENDING_PER_SLOT = {"gpt": 4, "stream": 2}
REPETITION_WINDOW = 16  # upstream CustomRepetitionPenaltyLogitsProcessorRepeat past_window
MAX_EMPTY_RETRIES = 16  # ensure_non_empty re-draws of the first step before giving up
MIN_TOKENS_TO_KEEP = 3  # upstream top-P/top-K warpers

# Special tokens the ChatTTS tokenizer holds (order here is the synthetic tokenizer's id order).
SPECIAL_TOKENS = (
    ["[Sbreak]", "[Pbreak]", "[Ebreak]", "[Stts]", "[Ptts]", "[spk_emb]", "[empty_spk]"]
    + ["[uv_break]", "[lbreak]"]
    + [f"[laugh_{i}]" for i in range(3)]
    + [f"[break_{i}]" for i in range(8)]
    + [f"[oral_{i}]" for i in range(10)]
    + [f"[speed_{i}]" for i in range(10)]
)
TEXT_EOS_TOKEN = "[Ebreak]"
SPK_EMB_TOKEN = "[spk_emb]"
REFINE_KEEP_BELOW_TOKEN = "[break_0]"  # refined text keeps ids below this one (upstream)


# --- architecture ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTDims:
    hidden: int = 768
    intermediate: int = 3072
    heads: int = 12
    kv_heads: int = 12
    layers: int = 20
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class ConvNetDims:
    """A DVAE-style decoder: conv_in (idim → bn → hidden), n ConvNeXt blocks, conv_out → odim."""

    idim: int
    odim: int
    hidden: int
    n_layer: int
    bn_dim: int


@dataclass(frozen=True)
class VocosDims:
    dim: int = 512
    intermediate: int = 1536
    layers: int = 8


@dataclass(frozen=True)
class Arch:
    gpt: GPTDims = GPTDims()
    decoder: ConvNetDims = ConvNetDims(idim=384, odim=384, hidden=512, n_layer=12, bn_dim=128)
    dvae_decoder: ConvNetDims = ConvNetDims(idim=512, odim=512, hidden=256, n_layer=12, bn_dim=128)
    dvae_encoder: ConvNetDims = ConvNetDims(idim=512, odim=1024, hidden=256, n_layer=12, bn_dim=128)
    vq_dim: int = 1024
    vq_levels: tuple = (5, 5, 5, 5)
    vq_groups: int = 2
    vq_residual: int = 2
    vocos: VocosDims = VocosDims()
    num_text_tokens: int = NUM_TEXT_TOKENS
    num_audio_tokens: int = NUM_AUDIO_TOKENS
    num_vq: int = NUM_VQ

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> Arch:
        return Arch(
            gpt=GPTDims(**d["gpt"]),
            decoder=ConvNetDims(**d["decoder"]),
            dvae_decoder=ConvNetDims(**d["dvae_decoder"]),
            dvae_encoder=ConvNetDims(**d["dvae_encoder"]),
            vq_dim=d["vq_dim"],
            vq_levels=tuple(d["vq_levels"]),
            vq_groups=d["vq_groups"],
            vq_residual=d["vq_residual"],
            vocos=VocosDims(**d["vocos"]),
            num_text_tokens=d["num_text_tokens"],
            num_audio_tokens=d["num_audio_tokens"],
            num_vq=d["num_vq"],
        )


FULL_ARCH = Arch()
# Same module classes at small widths, for fast tests. Token vocabularies and audio framing stay.
TINY_ARCH = Arch(
    gpt=GPTDims(hidden=64, intermediate=128, heads=4, kv_heads=4, layers=2),
    decoder=ConvNetDims(idim=32, odim=32, hidden=48, n_layer=2, bn_dim=16),
    dvae_decoder=ConvNetDims(idim=32, odim=32, hidden=32, n_layer=2, bn_dim=16),
    dvae_encoder=ConvNetDims(idim=32, odim=64, hidden=32, n_layer=2, bn_dim=16),
    vq_dim=64,
    vocos=VocosDims(dim=64, intermediate=128, layers=2),
)
ARCHS = {"full": FULL_ARCH, "tiny": TINY_ARCH}


# --- sampling defaults (upstream Chat.RefineTextParams / Chat.InferCodeParams) -----------------
@dataclass
class RefineTextParams:
    prompt: str = ""
    top_P: float = 0.7
    top_K: int = 20
    temperature: float = 0.7
    repetition_penalty: float = 1.0
    max_new_token: int = 384
    min_new_token: int = 0
    ensure_non_empty: bool = True
    manual_seed: int | None = None


@dataclass
class InferCodeParams(RefineTextParams):
    prompt: str = "[speed_5]"
    spk_emb: str | None = None
    spk_smp: str | None = None
    txt_smp: str | None = None
    temperature: float = 0.3
    repetition_penalty: float = 1.05
    max_new_token: int = 2048


# --- precisions --------------------------------------------------------------------------------
# export/serving precision -> torch dtype of the engine (activations, KV cache) and of the codec
# weights. "int8": the GPT's linear weights are quantised dynamically to int8 (CPU only).
PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "float32"}
CPU_ONLY_PRECISIONS = ("int8",)
# The engines' KV cache: "auto" holds keys and values in the engine's precision; "fp8" as float8 e4m3 (one byte a
# value, saturated at its largest finite magnitude, no scale), which halves what a decode step's attention reads.
# GPUs of compute capability 8.9 or later (the decode kernel converts e4m3 in registers) and the compiled step only.
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn"}
KV_CACHE_FP8_CAPABILITY = (8, 9)


# --- the KV cache ------------------------------------------------------------------------------
# The engines' keys and values live in a pool of pages of this many positions; a request holds the pages
# its positions reach (a block table per slot), not a whole context: a 150-frame utterance holds ≈ 14
# pages of 16 where a slot of the full context would hold 3072 positions
KV_PAGE_TOKENS = 16


# --- limits ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    max_text_chars: int = 2000
    max_context: int = 4096  # prompt + generated tokens, per request (GPT positions)
    max_new_tokens: int = 2048
    max_prompt_tokens: int = 1024
    max_reference_audio_seconds: float = 15.0  # ≈ 704 codes: fits max_prompt_tokens with the text


LIMITS = Limits()

# --- the models of a repository -----------------------------------------------------------------
ENSEMBLE = "chattts"  # the public contract: preprocess -> GPT -> vocoder
STREAM = "chattts_stream"  # decoupled: the ensemble's inputs, audio in chunks
PREPROCESS = "chattts_preprocess"
GPT = "chattts_gpt"
VOCODER = "chattts_vocoder"
MANIFEST = "manifest.json"  # beside the model folders: the architecture, tokens and deployment it was exported with
# the voice registry (runtime/voices.py), shared by every model and replica that reads the repository
VOICES = "voices.json"
# the voice store's URL in place of the deployment's `voice_store` setting, where set (runtime/stores.py): a URL with a
# password then stays out of the configs
VOICE_STORE_ENV = "CHATTTS_VOICE_STORE"
LEXICON = "lexicon.json"  # the pronunciation lexicon (runtime/lexicon.py), read as the voice registry is

# --- what the launcher and the models tell each other ------------------------------------------
# the ensemble's entries (chattts_preprocess, chattts_stream) refuse new requests while this file exists: the launcher
# drains before it signals Triton, which would fail in-flight ensemble requests at their next step
DRAIN_FILE_ENV = "CHATTTS_DRAIN_FILE"
INFLIGHT_METRIC = "chattts_inflight_requests"  # per model instance: requests admitted and not yet answered
# every python model's process writes all its threads' stacks to stderr (the server's log) on this signal; the
# launcher sends it to the stubs of a server whose drain outlasts half its exit timeout, so that a drain Triton's
# exit timeout cuts short shows where it waited
STACKS_SIGNAL = signal.SIGUSR1

# --- the public contract of the `chattts` ensemble ---------------------------------------------
# name -> (triton dtype, dims, required)
ENSEMBLE_INPUTS = {
    "TEXT": ("TYPE_STRING", [1], True),
    "SPEAKER": ("TYPE_STRING", [1], False),
    "SEED": ("TYPE_INT64", [1], False),
    "TEMPERATURE": ("TYPE_FP32", [1], False),
    "TOP_P": ("TYPE_FP32", [1], False),
    "TOP_K": ("TYPE_INT32", [1], False),
    "REPETITION_PENALTY": ("TYPE_FP32", [1], False),
    "MAX_NEW_TOKENS": ("TYPE_INT32", [1], False),
    "MIN_NEW_TOKENS": ("TYPE_INT32", [1], False),
    "PROMPT": ("TYPE_STRING", [1], False),
    "REFINE_TEXT": ("TYPE_BOOL", [1], False),
    "REFINE_PROMPT": ("TYPE_STRING", [1], False),
    "REFINE_TEMPERATURE": ("TYPE_FP32", [1], False),
    "REFINE_TOP_P": ("TYPE_FP32", [1], False),
    "REFINE_TOP_K": ("TYPE_INT32", [1], False),
    "REFINE_REPETITION_PENALTY": ("TYPE_FP32", [1], False),
    "REFINE_MAX_NEW_TOKENS": ("TYPE_INT32", [1], False),
    "USE_DECODER": ("TYPE_BOOL", [1], False),
    "NORMALIZE_TEXT": ("TYPE_BOOL", [1], False),
    "SPEAKER_AUDIO": ("TYPE_FP32", [-1], False),  # 24 kHz mono reference audio (spk_smp)
    "SPEAKER_TEXT": ("TYPE_STRING", [1], False),  # transcript of the reference speaker (txt_smp)
    "SPEAKER_SAMPLE": ("TYPE_STRING", [1], False),  # spk_smp string, as Chat.sample_audio_speaker returns
    "VOICE": ("TYPE_STRING", [1], False),  # a voice of the repository's registry (voices.py) or a seed number
}
ENSEMBLE_OUTPUTS = {
    "AUDIO": ("TYPE_FP32", [-1]),
    # the text the GPT reads: TEXT after normalisation (spoken form) and refine-text; chattts_stream sends it with
    # its first response
    "SPOKEN_TEXT": ("TYPE_STRING", [1]),
}

# Voices every new repository holds (export writes them into its voices.json): OpenAI's voice names, so a
# client of the speech API can say voice="alloy", each the speaker `torch.manual_seed(seed);
# Chat.sample_random_speaker()` gives. The seeds are speakers ChatTTS users share by number; what each sounds
# like depends on the weights (not heard here: no real weights), so listen and re-map with the voices CLI.
BUILTIN_VOICE_SEEDS = {"alloy": 2222, "echo": 6653, "fable": 4099, "onyx": 7869, "nova": 5099, "shimmer": 1111}

# Defaults of the optional contract inputs that are not sampling parameters.
REFINE_TEXT_DEFAULT = False  # upstream refines by default; a TTS service should not rewrite text unasked
USE_DECODER_DEFAULT = True
NORMALIZE_TEXT_DEFAULT = True

# chattts_stream counts its first chunks sent within each bound of their stream's start (cumulative):
# the server's share of a client's first-chunk percentiles, which the means alone cannot tell apart
# from a slow delivery
FIRST_CHUNK_BUCKETS_MS = (25, 50, 75, 100, 125, 150, 200, 250, 300, 400, 500, 1000, 2000, 5000, 10000)  # CPUs: ≈ 0.9 s


def first_chunk_bucket(ms: int) -> str:
    """The counter (and `chattts_<name>` gauge) of first chunks sent within `ms` of their stream's start."""
    return f"stream_first_chunks_within_{ms}ms"


def dump(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False)

