"""Request tensors of the `chattts` ensemble, built from chattts_triton.config (never copied here).

`SynthesisOptions` holds every optional contract input as a field named after it in lower case (TOP_P -> top_p), as
vLLM's `SamplingParams` holds sampling: the sync and async clients, whole, batched and streamed, the balancers and
the command line all take one.

    opts = SynthesisOptions(seed=7, temperature=0.3, voice="alloy")
    audio = client.synthesize(text, opts)
    audio = client.synthesize(text, opts, top_p=0.5)          # keywords of the field names override fields
    audio = client.synthesize(text, seed=7, temperature=0.3)  # as before: the keywords alone

A field left at None is not sent, so the server applies its default; `SynthesisOptions.server_defaults()` says what
those are, read from the config the server reads (upstream `InferCodeParams` / `RefineTextParams`). Values are
checked once, when the options are made, against the input's contract type; an error names the field.
`to_inputs(text)` is the request's tensors, the one encoding every transport sends (gRPC, HTTP, HTTP
generate_stream). The ensemble batches (`max_batch_size` > 0), so one request carries each input with a leading
batch dimension of 1.

Adding a contract input: its entry in config.ENSEMBLE_INPUTS and its field here; no method signature changes (the
clients' methods take `options` and `**overrides`, and show the fields in their signatures through `takes_options`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from chattts_triton import config as C

from .errors import INTERNAL, ChatTTSError, ChatTTSInputError

MODEL = C.ENSEMBLE
STREAM_MODEL = C.STREAM  # decoupled variant (AUDIO chunks), see ChatTTSClient.stream
TEXT_INPUT = "TEXT"
AUDIO_OUTPUT = "AUDIO"
SPOKEN_TEXT_OUTPUT = "SPOKEN_TEXT"  # what the server voices: TEXT after normalisation (and refine-text)
SAMPLE_RATE = C.SAMPLE_RATE

REQUIRED_INPUTS = [name for name, (_, _, required) in C.ENSEMBLE_INPUTS.items() if required]
# keyword -> contract input name, for every optional input
OPTION_INPUTS: dict[str, str] = {
    name.lower(): name for name, (_, _, required) in C.ENSEMBLE_INPUTS.items() if not required
}

# Only per-item scalars ([1]) and 1-D variable-length tensors ([-1]) are supported; fail loudly at
# import if the contract grows a shape this module does not know how to build.
for _name, (_dtype, _dims, _req) in C.ENSEMBLE_INPUTS.items():
    if list(_dims) not in ([1], [-1]):
        raise ImportError(f"client.contract cannot build input {_name} with dims {_dims}")
if (REQUIRED_INPUTS != [TEXT_INPUT] or AUDIO_OUTPUT not in C.ENSEMBLE_OUTPUTS
        or SPOKEN_TEXT_OUTPUT not in C.ENSEMBLE_OUTPUTS):
    raise ImportError("client.contract expects exactly TEXT required, an AUDIO and a SPOKEN_TEXT output")


def triton_datatype(config_dtype: str) -> str:
    """Model-config dtype ('TYPE_STRING', 'TYPE_FP32') -> protocol datatype ('BYTES', 'FP32')."""
    name = config_dtype.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def input_datatype(name: str) -> str:
    return triton_datatype(C.ENSEMBLE_INPUTS[name][0])


def _numpy_dtype(datatype: str):
    from tritonclient.utils import triton_to_np_dtype

    return triton_to_np_dtype(datatype)


def _scalar(name: str, datatype: str, value: Any):
    what = f"{name.lower()}={value!r}"
    if datatype == "BYTES":
        if not isinstance(value, str):
            raise ChatTTSInputError(f"{what}: expected a str")
        return value.encode("utf-8")
    if datatype == "BOOL":
        if not isinstance(value, (bool, np.bool_)):
            raise ChatTTSInputError(f"{what}: expected a bool")
        return bool(value)
    np_dtype = _numpy_dtype(datatype)
    if datatype.startswith(("INT", "UINT")):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise ChatTTSInputError(f"{what}: expected an int")
        info = np.iinfo(np_dtype)
        if not info.min <= int(value) <= info.max:
            raise ChatTTSInputError(f"{what}: out of {datatype} range [{info.min}, {info.max}]")
        return int(value)
    if datatype.startswith(("FP", "BF")):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise ChatTTSInputError(f"{what}: expected a number")
        if not math.isfinite(float(value)):
            raise ChatTTSInputError(f"{what}: must be finite")
        return float(value)
    raise ChatTTSInputError(f"{what}: unsupported datatype {datatype}")


def _vector(name: str, datatype: str, value: Any) -> np.ndarray:
    if datatype != "FP32":
        raise ChatTTSInputError(f"{name.lower()}: unsupported variable-length datatype {datatype}")
    try:
        arr = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ChatTTSInputError(f"{name.lower()}: expected a 1-D array of samples ({e})") from None
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or arr.size == 0:
        raise ChatTTSInputError(f"{name.lower()}: expected a non-empty 1-D array, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ChatTTSInputError(f"{name.lower()}: contains NaN or infinite samples")
    return arr


def encode_input(name: str, value: Any) -> np.ndarray:
    """One contract input as the array a single request sends ([1,1] or [1,N])."""
    datatype = input_datatype(name)
    dims = list(C.ENSEMBLE_INPUTS[name][1])
    if dims == [-1]:
        return np.ascontiguousarray(_vector(name, datatype, value)[None, :])
    return np.array([[_scalar(name, datatype, value)]], dtype=_numpy_dtype(datatype))


def check_options(options: Mapping[str, Any]) -> None:
    unknown = sorted(set(options) - set(OPTION_INPUTS))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; valid: {sorted(OPTION_INPUTS)}")


def build_inputs(text: str, options: Any = None) -> dict[str, np.ndarray]:
    """Contract input name -> array for one utterance; options left at None are omitted. `options`: a
    `SynthesisOptions`, a mapping of its field names, or None (its `to_inputs`: the one encoding)."""
    return SynthesisOptions.of(options).to_inputs(text)


# --- SynthesisOptions: every optional input as one frozen value ----------------------------------------------------
_CODE, _REFINE = C.InferCodeParams, C.RefineTextParams  # upstream's defaults, as the server reads them


def _option(server_default: Any = None) -> Any:
    """A field: None (not sent) by default; `server_default` is what the server uses then (None: random / none)."""
    return dataclasses.field(default=None, metadata={"server_default": server_default})


@dataclasses.dataclass(frozen=True, eq=False)
class SynthesisOptions:
    """The optional inputs of one synthesis request; None = not sent (the server's default). See the module doc."""

    speaker: str | None = _option()  # upstream speaker-embedding string (Chat.sample_random_speaker)
    seed: int | None = _option()  # sampling seed; the audio depends only on the inputs and the seed
    temperature: float | None = _option(_CODE.temperature)
    top_p: float | None = _option(_CODE.top_P)
    top_k: int | None = _option(_CODE.top_K)
    repetition_penalty: float | None = _option(_CODE.repetition_penalty)
    max_new_tokens: int | None = _option(min(_CODE.max_new_token, C.LIMITS.max_new_tokens))  # code frames
    min_new_tokens: int | None = _option(_CODE.min_new_token)
    prompt: str | None = _option(_CODE.prompt)  # control tokens, e.g. "[speed_3]"
    refine_text: bool | None = _option(C.REFINE_TEXT_DEFAULT)
    refine_prompt: str | None = _option(_REFINE.prompt)
    refine_temperature: float | None = _option(_REFINE.temperature)
    refine_top_p: float | None = _option(_REFINE.top_P)
    refine_top_k: int | None = _option(_REFINE.top_K)
    refine_repetition_penalty: float | None = _option(_REFINE.repetition_penalty)
    refine_max_new_tokens: int | None = _option(_REFINE.max_new_token)
    use_decoder: bool | None = _option(C.USE_DECODER_DEFAULT)
    normalize_text: bool | None = _option(C.NORMALIZE_TEXT_DEFAULT)
    speaker_audio: np.ndarray | None = _option()  # 24 kHz mono reference samples (upstream spk_smp)
    speaker_text: str | None = _option()  # the reference's transcript (txt_smp)
    speaker_sample: str | None = _option()  # spk_smp string, as Chat.sample_audio_speaker returns
    voice: str | None = _option()  # a voice of the server's registry, or a seed number

    def __post_init__(self) -> None:
        # the one check of every value: its contract input's encoding (an error names the field); the arrays are
        # kept, so each request reuses them
        arrays: dict[str, np.ndarray] = {}
        for name in OPTION_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            input_name = OPTION_INPUTS[name]
            if list(C.ENSEMBLE_INPUTS[input_name][1]) == [-1]:
                # samples: kept as checked (1-D float32; the very array given when it is one), sent as a [1, N] view
                samples = _vector(input_name, input_datatype(input_name), value)
                object.__setattr__(self, name, samples)
                arr = np.ascontiguousarray(samples[None, :])
            else:
                arr = encode_input(input_name, value)
            arr.flags.writeable = False
            arrays[input_name] = arr
        object.__setattr__(self, "_arrays", arrays)

    # --- making one ---------------------------------------------------------------------------------------------
    @classmethod
    def of(cls, options: SynthesisOptions | Mapping[str, Any] | None = None, **overrides: Any) -> SynthesisOptions:
        """`options` (a SynthesisOptions, a mapping of field names, or None) with `overrides` of the same names on top.
        An unknown name is a TypeError that names it."""
        if isinstance(options, SynthesisOptions):
            return options.replace(**overrides) if overrides else options
        values = dict(options or {})
        values.update(overrides)
        check_options(values)
        return cls(**values)

    def replace(self, **changes: Any) -> SynthesisOptions:
        """A copy with `changes` (field names; None: back to the server's default)."""
        check_options(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def server_defaults(cls) -> dict[str, Any]:
        """Field -> what the server uses when it is not sent (None: a random speaker / seed, no reference, ...),
        from chattts_triton.config (`max_new_tokens`: at most; a deployment may allow fewer)."""
        return {f.name: f.metadata["server_default"] for f in dataclasses.fields(cls)}

    # --- reading one --------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (not None), by name: the keywords of the clients' methods."""
        return {name: getattr(self, name) for name in OPTION_FIELDS if getattr(self, name) is not None}

    def to_inputs(self, text: str) -> dict[str, np.ndarray]:
        """The request's tensors for one utterance: contract input name -> array ([1, 1], SPEAKER_AUDIO [1, N]);
        fields left at None are not sent."""
        if not isinstance(text, str):
            raise ChatTTSInputError(f"text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise ChatTTSInputError("text is empty")
        return {TEXT_INPUT: encode_input(TEXT_INPUT, text), **self._arrays}

    # --- read as the mapping of the fields it sends (the clients' keywords): `opts["top_p"]` is `opts.top_p` (None:
    # not sent), `"top_p" in opts` says whether it is sent; keys(), items(), len() and `**opts` are the fields sent
    def __getitem__(self, name: str) -> Any:
        if name not in OPTION_INPUTS:
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        value = self[name] if name in OPTION_INPUTS else None
        return default if value is None else value

    def __contains__(self, name: object) -> bool:
        return name in OPTION_INPUTS and getattr(self, name) is not None

    def keys(self) -> list[str]:
        return [name for name in OPTION_FIELDS if getattr(self, name) is not None]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def items(self) -> list[tuple[str, Any]]:
        return list(self.to_dict().items())

    def values(self) -> list[Any]:
        return list(self.to_dict().values())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SynthesisOptions):
            return NotImplemented
        mine, theirs = self._arrays, other._arrays
        return mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)

    __hash__ = None  # holds arrays; compare with ==

    def __repr__(self) -> str:
        def show(value: Any) -> str:
            return f"<{value.dtype}[{value.size}]>" if isinstance(value, np.ndarray) else repr(value)

        return f"{type(self).__name__}({', '.join(f'{k}={show(v)}' for k, v in self.to_dict().items())})"


OPTION_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SynthesisOptions))
if set(OPTION_FIELDS) != set(OPTION_INPUTS):  # the contract (config.ENSEMBLE_INPUTS) and the fields must agree
    raise ImportError(f"SynthesisOptions fields {sorted(set(OPTION_FIELDS) ^ set(OPTION_INPUTS))} "
                      "do not match the contract")


F = TypeVar("F", bound=Callable[..., Any])


def takes_options(method: F) -> F:
    """Show every field of SynthesisOptions as a keyword-only parameter (default None) in `method`'s signature, in
    place of its `**overrides` (help(), IDEs, inspect.signature). The method itself names no field: one added to
    SynthesisOptions appears here without any signature being edited."""
    signature = inspect.signature(method)
    params = list(signature.parameters.values())
    if not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"{method.__qualname__} must end with **overrides")
    own = [p for p in params[:-1] if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    own_keywords = [p for p in params[:-1] if p.kind is inspect.Parameter.KEYWORD_ONLY]
    fields = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=f.type)
        for f in dataclasses.fields(SynthesisOptions)
    ]
    method.__signature__ = signature.replace(parameters=own + fields + own_keywords)
    return method


def to_infer_inputs(module, arrays: Mapping[str, np.ndarray]) -> list[Any]:
    """Wrap arrays as `module.InferInput`s (module: tritonclient.grpc or tritonclient.http)."""
    inputs = []
    for name, arr in arrays.items():
        inp = module.InferInput(name, list(arr.shape), input_datatype(name))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


def requested_outputs(module, spoken_text: bool = False) -> list[Any]:
    """AUDIO, and SPOKEN_TEXT when asked for (a server exported before it refuses to be asked)."""
    names = [AUDIO_OUTPUT, SPOKEN_TEXT_OUTPUT] if spoken_text else [AUDIO_OUTPUT]
    return [module.InferRequestedOutput(n) for n in names]


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple, np.ndarray)):
        flat = np.asarray(value, dtype=object).reshape(-1)
        if flat.size != 1:
            raise ChatTTSError(INTERNAL, f"{SPOKEN_TEXT_OUTPUT} holds {flat.size} values, expected one")
        value = flat[0]
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    raise ChatTTSError(INTERNAL, f"{SPOKEN_TEXT_OUTPUT} is not text: {value!r:.200}")


def spoken_text_from_result(result) -> str | None:
    """SPOKEN_TEXT of one response (gRPC or HTTP InferResult), None when it does not carry it."""
    value = result.as_numpy(SPOKEN_TEXT_OUTPUT)
    return None if value is None else _text(value)


def spoken_text_from_json(event: Mapping[str, Any]) -> str | None:
    """SPOKEN_TEXT of one generate_stream event (a string, or a one-item list), None when it has none."""
    return _text(event[SPOKEN_TEXT_OUTPUT]) if SPOKEN_TEXT_OUTPUT in event else None


def _audio_row(audio: np.ndarray) -> np.ndarray:
    if audio.ndim != 2 or audio.shape[0] != 1:
        raise ChatTTSError(INTERNAL, f"{AUDIO_OUTPUT} has shape {audio.shape}, expected [1, N]")
    return np.array(audio[0], dtype=np.float32)


def audio_from_result(result) -> np.ndarray:
    """AUDIO of one response as an owned, writable 1-D float32 array."""
    audio = result.as_numpy(AUDIO_OUTPUT)
    if audio is None:
        raise ChatTTSError(INTERNAL, f"response has no {AUDIO_OUTPUT} output")
    return _audio_row(audio)


# --- the decoupled STREAM_MODEL: same inputs, one AUDIO chunk per response ----------------------
FINAL_PARAMETER = "triton_final_response"


def chunk_from_result(result) -> tuple[np.ndarray, bool]:
    """(AUDIO chunk, is the last response) of one gRPC stream response. An empty final response
    (no outputs) is a 0-sample last chunk."""
    params = result.get_response().parameters
    final = FINAL_PARAMETER in params and params[FINAL_PARAMETER].bool_param
    audio = result.as_numpy(AUDIO_OUTPUT)
    if audio is None:
        if final:
            return np.zeros(0, np.float32), True
        raise ChatTTSError(INTERNAL, f"stream response has no {AUDIO_OUTPUT} output")
    return _audio_row(audio), final


def to_json_inputs(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Body of an HTTP generate_stream request: name -> scalar ([1, 1] inputs) or list ([1, N])."""
    body: dict[str, Any] = {}
    for name, arr in arrays.items():
        if list(C.ENSEMBLE_INPUTS[name][1]) == [-1]:
            body[name] = arr.reshape(-1).tolist()
        else:
            value = arr.reshape(-1)[0]
            body[name] = value.decode("utf-8") if isinstance(value, bytes) else value.item()
    return body


def chunk_from_json(event: Mapping[str, Any]) -> np.ndarray:
    """AUDIO of one generate_stream event (a flat list; [] for a 0-sample chunk)."""
    if AUDIO_OUTPUT not in event:
        raise ChatTTSError(INTERNAL, f"stream event has no {AUDIO_OUTPUT}: {sorted(event)}")
    try:
        return np.asarray(event[AUDIO_OUTPUT], dtype=np.float32).reshape(-1)
    except (TypeError, ValueError) as e:
        raise ChatTTSError(INTERNAL, f"stream event {AUDIO_OUTPUT} is not a list of numbers ({e})") from None
