"""How a service receives requests and reads their contract inputs.

A service gets a batch of `Call`s; each carries its request's inputs (numpy arrays, BYTES as object
arrays, shaped with the leading batch dimension of 1) and a `reply` to call exactly once with a dict of
outputs or an exception (`chattts_triton.triton.backend` adapts this to the python backend; tests drive
the services directly). The decoders here turn an input into a value or an `InputError` naming it: a wrong shape,
a value out of bounds or not finite, text that is not UTF-8, and a value of the wrong kind (text or a float where
an integer is read, anything but a boolean where a boolean is) — Triton checks the dtypes of requests it
receives, not those of the dicts the ensemble, BLS and tests hand the services (`tests/test_inputs.py`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import LIMITS, RefineTextParams
from ..model.text import InputError
from .engine import SamplingParams

Outputs = dict[str, np.ndarray]
Reply = Callable[[Any], None]


class Overloaded(RuntimeError):
    """The server is at capacity: the client should retry later (Triton UNAVAILABLE, HTTP 503)."""


@dataclass
class Call:
    inputs: dict[str, Any]
    reply: Reply



def _one(inputs: dict[str, Any], name: str):
    """The single value of a [1, 1] input, or None when the request omitted it."""
    v = inputs.get(name)
    if v is None:
        return None
    arr = np.asarray(v)
    if arr.size != 1:
        raise InputError(f"{name} must hold exactly one value per request, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _wrong_kind(name: str, v, want: str) -> InputError:
    return InputError(f"{name} must be {want}, got {type(v).__name__} {v!r:.40}")


def _integer(v, name: str) -> int:
    """An integer input's value; a float, a boolean or text is the wrong kind, named."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise _wrong_kind(name, v, "an integer")
    return int(v)


def get_str(inputs, name: str, default: str | None = None) -> str | None:
    v = _one(inputs, name)
    if v is None:
        return default
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(v, str):
        raise _wrong_kind(name, v, "text (BYTES)")
    return str(v)


def get_float(inputs, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = _one(inputs, name)
    if v is None:
        return default
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise _wrong_kind(name, v, "a number")
    try:
        f = float(v)
    except OverflowError:  # an int beyond any float
        f = math.inf
    if not math.isfinite(f) or f > hi or f < lo or (lo_open and f <= lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InputError(f"{name} must be a finite number in {bound}, got {f}")
    return f


def get_int(inputs, name: str, default: int, lo: int, hi: int) -> int:
    v = _one(inputs, name)
    if v is None:
        return default
    i = _integer(v, name)
    if i < lo or i > hi:
        raise InputError(f"{name} must be in [{lo}, {hi}], got {i}")
    return i


def get_bool(inputs, name: str, default: bool) -> bool:
    v = _one(inputs, name)
    if v is None:
        return default
    if not isinstance(v, (bool, np.bool_)):  # bool(b"false") would be True
        raise _wrong_kind(name, v, "a boolean")
    return bool(v)


def named(name: str, fn, *args):
    """Run a decoder of client input; its InputError names the contract input at fault."""
    try:
        return fn(*args)
    except InputError as e:
        msg = str(e)
        raise InputError(msg if msg.startswith(name) else f"{name}: {msg}") from None


def get_seed(inputs) -> int:
    v = _one(inputs, "SEED")
    if v is None:
        return secrets.randbits(63)
    seed = _integer(v, "SEED")
    if not -(1 << 63) <= seed < (1 << 63):  # the engine keeps seeds in int64
        raise InputError(f"SEED must be a 64-bit integer, got {seed}")
    return seed


def sampling_params(inputs, defaults, max_new_limit: int = LIMITS.max_new_tokens) -> SamplingParams:
    """Upstream InferCodeParams/RefineTextParams semantics with request overrides and range checks."""
    max_new = get_int(inputs, "MAX_NEW_TOKENS", min(defaults.max_new_token, max_new_limit), 1, max_new_limit)
    min_new = get_int(inputs, "MIN_NEW_TOKENS", defaults.min_new_token, 0, max_new_limit)
    if min_new > max_new:
        raise InputError(f"MIN_NEW_TOKENS ({min_new}) must not exceed MAX_NEW_TOKENS ({max_new})")
    return SamplingParams(
        temperature=get_float(inputs, "TEMPERATURE", defaults.temperature, 0.0, 100.0, lo_open=True),
        top_p=get_float(inputs, "TOP_P", defaults.top_P, 0.0, 1.0, lo_open=True),
        top_k=get_int(inputs, "TOP_K", defaults.top_K, 1, 1 << 30),
        repetition_penalty=get_float(inputs, "REPETITION_PENALTY", defaults.repetition_penalty, 0.0, 100.0,
                                     lo_open=True),
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        seed=get_seed(inputs),
        ensure_non_empty=defaults.ensure_non_empty,
    )


def refine_request(ids: np.ndarray, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """GPT model inputs of a refine-text generation (`ids` from text.build_refine_prompt)."""
    inputs = {"TEXT_IDS": np.asarray(ids).reshape(1, -1).astype(np.int64), "REFINE": np.array([[True]])}
    inputs.update({k: np.asarray(v) for k, v in params.items()})
    return inputs


def refine_params(inputs) -> dict[str, Any]:
    """REFINE_* sampling inputs under the plain names the GPT model takes, range-checked here."""
    params = {k[len("REFINE_"):]: v for k, v in inputs.items()
              if k.startswith("REFINE_") and k not in ("REFINE_TEXT", "REFINE_PROMPT")}
    try:
        sampling_params({**params, "SEED": 0}, RefineTextParams)
    except InputError as e:
        raise InputError(f"REFINE_{e}") from None
    return params

