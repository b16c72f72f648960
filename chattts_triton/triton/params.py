"""The parameters of each python model, typed: one dataclass per model that `repo_config` writes into the model's
`config.pbtxt` and the backend reads back (`ModelContext.params`).

A field's name is the parameter's key and, for what a deployment sets, the `Deployment` field (deployment.py) and
its flag: `gpt_slots` is `--gpt-slots` and `Deployment.gpt_slots`; `of` copies those by name, so a new setting a
model reads is one field here and one in `Deployment`. A field's default is what a repository configured before the
parameter existed gets (where that is the deployment's default, it names the field's); a field without one must be
in the config; `RENAMED` reads the keys such a repository used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, get_type_hints

from ..config import GPT, Arch
from ..model.chunks import stream_schedule
from .deployment import AUTO, Deployment

P = TypeVar("P", bound="Params")


def to_text(value: Any) -> str:
    """A parameter's string_value: None is AUTO, a flag 1 or 0."""
    if value is None:
        return AUTO
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


def _parse(kind: Any, text: str) -> Any:
    if kind in (int | None, float | None):
        return None if text == AUTO else (int if kind == (int | None) else float)(text)
    if kind is bool:
        return bool(int(text))
    return kind(text)


@dataclass(frozen=True)
class Params:
    RENAMED: ClassVar[dict[str, str]] = {}  # key in repositories configured before -> field

    @classmethod
    def of(cls: type[P], deployment: Any, **derived: Any) -> P:
        """The parameters a deployment gives: the fields of the same name as Deployment's, and `derived` (what the
        model gets worked out from it)."""
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in derived:
                values[f.name] = derived.pop(f.name)
            elif hasattr(deployment, f.name):
                values[f.name] = getattr(deployment, f.name)
            else:
                raise TypeError(f"{cls.__name__}.{f.name} is no Deployment field: give it")
        if derived:
            raise TypeError(f"{cls.__name__} has no parameter {', '.join(derived)}")
        return cls(**values)

    def texts(self) -> dict[str, str]:
        """{key: string_value}, as config.pbtxt holds them."""
        return {f.name: to_text(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def read(cls: type[P], model: str, parameters: Mapping[str, Mapping[str, str]]) -> P:
        """From a model config's `parameters` as Triton hands them to the model ({key: {"string_value": text}})."""
        kinds = get_type_hints(cls)
        old = {new: key for key, new in cls.RENAMED.items()}
        values = {}
        for f in dataclasses.fields(cls):
            entry = parameters.get(f.name, parameters.get(old.get(f.name, "")))
            if entry is None:
                if f.default is dataclasses.MISSING:
                    raise RuntimeError(f"model {model}: parameter {f.name!r} missing from config.pbtxt")
                continue
            # an empty string is no field of the protobuf's text or JSON: a str parameter's "" is an entry without it
            try:
                text = entry.get("string_value", "") if kinds[f.name] is str else entry["string_value"]
                values[f.name] = _parse(kinds[f.name], text)
            except (KeyError, ValueError) as e:
                raise RuntimeError(f"model {model}: parameter {f.name!r} is invalid: {entry}") from e
        return cls(**values)


@dataclass(frozen=True)
class PreprocessParams(Params):
    """`chattts_preprocess`."""

    gpt_model: str = GPT  # the model refine-text generates on
    artifact_format: str = "torchscript"
    # requests held (being prepared) at most, beyond which one is answered "server busy" at once (0: no bound): what
    # the GPT engines admit together, so that it never queues work they would refuse
    max_pending: int = 0
    voice_store: str = Deployment.voice_store  # where the named voices are kept (runtime/stores.py)


@dataclass(frozen=True, kw_only=True)
class EngineParams(Params):
    """What a model that hosts a GPT engine reads (`chattts_gpt`, `chattts_stream`); the engine's own size is its
    role's (`slots`, `cache_tokens`, `max_pending`)."""

    ROLE: ClassVar[str]
    gpt_context: int  # prompt + generated positions of one request
    max_new_tokens: int
    dtype: str = "fp32"
    gpu_memory_gb: float | None = None  # None: the card's
    instances: int = 1  # chattts_vocoder instances per GPU, which the engine's memory plan leaves room for
    gpt_compile: bool = False  # the decode step through torch.compile (GPU instances)
    gpt_compile_prefill: bool = False  # ... and the prefills
    gpt_packed_prefill: bool = Deployment.gpt_packed_prefill  # prompts prefilled packed (with gpt_compile)
    gpt_overlap: bool = True  # GPU engines: the host's bookkeeping of a step overlaps the next step
    gpt_gemv: bool = Deployment.gpt_gemv  # the compiled step of one row: projections as inductor's reductions
    gpt_gemv_tune: bool = Deployment.gpt_gemv_tune  # ... their launch configurations tuned at the warm-up
    kv_cache_dtype: str = Deployment.kv_cache_dtype  # the engines' KV cache: the precision's, or fp8 (config)
    gpt_admit_batch: int = Deployment.gpt_admit_batch
    gpt_admit_wait_steps: int = Deployment.gpt_admit_wait_steps
    gil_switch_interval_us: int = Deployment.gil_switch_interval_us

    @property
    def slots(self) -> int | None:  # None: sized from the GPU's memory
        raise NotImplementedError

    @property
    def engine_priority(self) -> bool:  # the engine's steps on a stream of the highest priority (Engine high_priority)
        return False

    @property
    def cache_tokens(self) -> int | None:  # None: on a GPU from its memory, on the CPU slots × context
        raise NotImplementedError

    @property
    def max_pending(self) -> int | None:  # running + waiting before UNAVAILABLE; 0: no bound; None: per slot
        raise NotImplementedError


_ENGINE_RENAMED = {"max_context": "gpt_context", "vocoder_instances": "instances", "compile_step": "gpt_compile",
                   "compile_prefill": "gpt_compile_prefill", "admit_batch": "gpt_admit_batch",
                   "admit_wait_steps": "gpt_admit_wait_steps"}


@dataclass(frozen=True, kw_only=True)
class GPTParams(EngineParams):
    """`chattts_gpt`."""

    ROLE = "gpt"
    RENAMED = {**_ENGINE_RENAMED, "max_slots": "gpt_slots", "cache_tokens": "gpt_cache_tokens",
               "max_pending": "gpt_max_pending"}
    gpt_slots: int | None
    gpt_cache_tokens: int | None = None
    gpt_max_pending: int | None = 0

    slots = property(lambda self: self.gpt_slots)
    cache_tokens = property(lambda self: self.gpt_cache_tokens)
    max_pending = property(lambda self: self.gpt_max_pending)


@dataclass(frozen=True, kw_only=True)
class StreamParams(EngineParams):
    """`chattts_stream`: its engine, and the chunks it sends (`schedule`)."""

    ROLE = "stream"
    RENAMED = {**_ENGINE_RENAMED, "max_slots": "stream_slots", "cache_tokens": "stream_cache_tokens",
               "max_pending": "stream_max_pending", "first_chunk_frames": "stream_first_chunk_frames",
               "chunk_frames": "stream_chunk_frames", "lookahead_frames": "stream_lookahead_frames",
               "first_lookahead_frames": "stream_first_lookahead_frames", "fade_frames": "stream_fade_frames",
               "codec_stream": "stream_codec_stream", "first_chunks_first": "stream_first_chunks_first"}
    stream_slots: int | None
    stream_cache_tokens: int | None = None
    stream_max_pending: int | None = 0
    artifact_format: str = "torchscript"
    stream_first_chunk_frames: int  # code frames (21.3 ms of audio each) in the first chunk
    stream_chunk_frames: int  # ... in each later chunk (more when generation runs ahead)
    stream_lookahead_frames: int = 0  # context each side of a chunk; 0: exact (codec.stream_lookahead_codes)
    stream_first_lookahead_frames: int = 0  # right context of the first chunk; 0: as the later chunks
    stream_fade_frames: int = 0  # frames cross-faded at each seam (model/chunks.py)
    stream_codec_stream: bool = False  # the codec on a CUDA stream of its own, beside the engine's steps
    stream_first_chunks_first: bool = False  # new streams' first chunks in a codec call of their own, first
    stream_engine_priority: bool = False  # the engine's steps on a CUDA stream of the highest priority
    codec_compile: bool = False  # the codec's graphs replay its networks through torch.compile
    voice_store: str = Deployment.voice_store  # where the named voices are kept, as chattts_preprocess reads them

    slots = property(lambda self: self.stream_slots)
    cache_tokens = property(lambda self: self.stream_cache_tokens)
    max_pending = property(lambda self: self.stream_max_pending)
    engine_priority = property(lambda self: self.stream_engine_priority)

    def schedule(self, arch: Arch) -> dict[str, int]:
        """The ChunkPlanner arguments (model/chunks.py stream_schedule; ValueError if refused)."""
        return stream_schedule(arch, self.stream_first_chunk_frames, self.stream_chunk_frames,
                               self.stream_lookahead_frames, self.stream_first_lookahead_frames,
                               self.stream_fade_frames)


@dataclass(frozen=True)
class VocoderParams(Params):
    """`chattts_vocoder`."""

    RENAMED = {"codec_graphs": "vocoder_graphs"}
    artifact_format: str = "torchscript"
    dtype: str = "fp32"
    vocoder_graphs: bool = False  # replay the codec from CUDA graphs (GPU, TorchScript artifacts)
    codec_compile: bool = False  # ... of its networks through torch.compile (with vocoder_graphs)
    gpu_memory_gb: float | None = None
