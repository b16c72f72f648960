"""`SynthesisOptions`: every optional input of the `chattts` contract as one frozen value (as vLLM's `SamplingParams`).

The sync and async clients, whole and streamed, the balancers and the command line all take one:

    opts = SynthesisOptions(seed=7, temperature=0.3, voice="alloy")
    audio = client.synthesize(text, opts)
    audio = client.synthesize(text, opts, top_p=0.5)      # keywords of the same names override fields
    audio = client.synthesize(text, seed=7, temperature=0.3)  # as before: the keywords alone

One field per optional contract input (chattts_triton.config.ENSEMBLE_INPUTS, TOP_P -> top_p). A field left at None
is not sent, so the server applies its default; `SynthesisOptions.server_defaults()` says what those are, read from
the same config the server reads (upstream `InferCodeParams` / `RefineTextParams`). Values are checked once, when the
options are made, against the input's contract type; an error names the field. `to_inputs(text)` is the request's
tensors, the one encoding every transport sends (gRPC, HTTP, HTTP generate_stream).

Adding a contract input: its entry in config.ENSEMBLE_INPUTS and its field here; no method signature changes (the
clients' methods take `options` and `**overrides`, and show the fields in their signatures through `takes_options`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, TypeVar, Union

import numpy as np

from chattts_triton import config as C

from .contract import OPTION_INPUTS, TEXT_INPUT, check_options, encode_input
from .errors import ChatTTSInputError

_CODE, _REFINE = C.InferCodeParams, C.RefineTextParams  # upstream's defaults, as the server reads them


def _option(server_default: Any = None) -> Any:
    """A field: None (not sent) by default; `server_default` is what the server uses then (None: random / none)."""
    return dataclasses.field(default=None, metadata={"server_default": server_default})


@dataclasses.dataclass(frozen=True, eq=False)
class SynthesisOptions:
    """The optional inputs of one synthesis request; None = not sent (the server's default). See the module doc."""

    speaker: Optional[str] = _option()  # upstream speaker-embedding string (Chat.sample_random_speaker)
    seed: Optional[int] = _option()  # sampling seed; the audio depends only on the inputs and the seed
    temperature: Optional[float] = _option(_CODE.temperature)
    top_p: Optional[float] = _option(_CODE.top_P)
    top_k: Optional[int] = _option(_CODE.top_K)
    repetition_penalty: Optional[float] = _option(_CODE.repetition_penalty)
    max_new_tokens: Optional[int] = _option(min(_CODE.max_new_token, C.LIMITS.max_new_tokens))  # code frames
    min_new_tokens: Optional[int] = _option(_CODE.min_new_token)
    prompt: Optional[str] = _option(_CODE.prompt)  # control tokens, e.g. "[speed_3]"
    refine_text: Optional[bool] = _option(C.REFINE_TEXT_DEFAULT)
    refine_prompt: Optional[str] = _option(_REFINE.prompt)
    refine_temperature: Optional[float] = _option(_REFINE.temperature)
    refine_top_p: Optional[float] = _option(_REFINE.top_P)
    refine_top_k: Optional[int] = _option(_REFINE.top_K)
    refine_repetition_penalty: Optional[float] = _option(_REFINE.repetition_penalty)
    refine_max_new_tokens: Optional[int] = _option(_REFINE.max_new_token)
    use_decoder: Optional[bool] = _option(C.USE_DECODER_DEFAULT)
    normalize_text: Optional[bool] = _option(C.NORMALIZE_TEXT_DEFAULT)
    speaker_audio: Optional[np.ndarray] = _option()  # 24 kHz mono reference samples (upstream spk_smp)
    speaker_text: Optional[str] = _option()  # the reference's transcript (txt_smp)
    speaker_sample: Optional[str] = _option()  # spk_smp string, as Chat.sample_audio_speaker returns
    voice: Optional[str] = _option()  # a voice of the server's registry, or a seed number

    def __post_init__(self) -> None:
        # the one check of every value: its contract input's encoding (an error names the field); the arrays are
        # kept, so each request reuses them
        arrays: Dict[str, np.ndarray] = {}
        for name in OPTION_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            arr = encode_input(OPTION_INPUTS[name], value)
            arr.flags.writeable = False
            arrays[OPTION_INPUTS[name]] = arr
            if list(C.ENSEMBLE_INPUTS[OPTION_INPUTS[name]][1]) == [-1]:  # samples: keep them as checked (1-D float32)
                object.__setattr__(self, name, arr[0])
        object.__setattr__(self, "_arrays", arrays)

    # --- making one ---------------------------------------------------------------------------------------------
    @classmethod
    def of(cls, options: Union["SynthesisOptions", Mapping[str, Any], None] = None, **overrides: Any) -> "SynthesisOptions":
        """`options` (a SynthesisOptions, a mapping of field names, or None) with `overrides` of the same names on top.
        An unknown name is a TypeError that names it."""
        if isinstance(options, SynthesisOptions):
            return options.replace(**overrides) if overrides else options
        values = dict(options or {})
        values.update(overrides)
        check_options(values)
        return cls(**values)

    def replace(self, **changes: Any) -> "SynthesisOptions":
        """A copy with `changes` (field names; None: back to the server's default)."""
        check_options(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def server_defaults(cls) -> Dict[str, Any]:
        """Field -> what the server uses when it is not sent (None: a random speaker / seed, no reference, ...),
        from chattts_triton.config (`max_new_tokens`: at most; a deployment may allow fewer)."""
        return {f.name: f.metadata["server_default"] for f in dataclasses.fields(cls)}

    # --- reading one --------------------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The fields that are set (not None), by name: the keywords of the clients' methods."""
        return {name: getattr(self, name) for name in OPTION_FIELDS if getattr(self, name) is not None}

    def to_inputs(self, text: str) -> Dict[str, np.ndarray]:
        """The request's tensors for one utterance: contract input name -> array ([1, 1], SPEAKER_AUDIO [1, N]);
        fields left at None are not sent."""
        if not isinstance(text, str):
            raise ChatTTSInputError(f"text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise ChatTTSInputError("text is empty")
        return {TEXT_INPUT: encode_input(TEXT_INPUT, text), **self._arrays}

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


OPTION_FIELDS: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SynthesisOptions))
if set(OPTION_FIELDS) != set(OPTION_INPUTS):  # the contract (config.ENSEMBLE_INPUTS) and the fields must agree
    raise ImportError(f"SynthesisOptions fields {sorted(set(OPTION_FIELDS) ^ set(OPTION_INPUTS))} do not match the contract")


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
