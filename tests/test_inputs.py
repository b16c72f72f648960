"""`chattts_triton.runtime.inputs`: request decoding, the first code bad input meets. Every decoder takes the value
of its kind and shape, answers the default when the input is omitted, and turns anything else into an `InputError`
whose message names the input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chattts_triton.config import LIMITS, InferCodeParams, RefineTextParams
from chattts_triton.model.text import InputError
from chattts_triton.runtime import inputs as I

NAN, INF = float("nan"), float("inf")


def one(value, dtype=None):
    """A contract input as Triton hands it over: [1, 1], BYTES as an object array."""
    return np.array([[value]], dtype=dtype)


def raises_naming(name: str, fn, *args, **kwargs) -> str:
    with pytest.raises(InputError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert msg.startswith(name), msg
    return msg


# --- shape: every decoder reads one value per request --------------------------------------------------------------
DECODERS = {
    "str": lambda inputs: I.get_str(inputs, "X"),
    "float": lambda inputs: I.get_float(inputs, "X", 0.5, 0.0, 1.0),
    "int": lambda inputs: I.get_int(inputs, "X", 1, 0, 10),
    "bool": lambda inputs: I.get_bool(inputs, "X", False),
}
GOOD = {"str": one(b"hi", object), "float": one(0.25, np.float32), "int": one(3, np.int32), "bool": one(True)}


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_each_decoder_reads_the_one_value_of_a_1x1_input(kind):
    assert DECODERS[kind]({"X": GOOD[kind]}) == {"str": "hi", "float": 0.25, "int": 3, "bool": True}[kind]
    assert DECODERS[kind]({"X": GOOD[kind].reshape(1)}) == DECODERS[kind]({"X": GOOD[kind]})  # [1] and scalars too
    assert DECODERS[kind]({"X": GOOD[kind].reshape(())}) == DECODERS[kind]({"X": GOOD[kind]})


@pytest.mark.parametrize("kind", sorted(DECODERS))
@pytest.mark.parametrize("shape", [(1, 2), (2, 1), (1, 0), (0,), (2, 2, 1)])
def test_a_wrong_shape_is_an_error_naming_the_input(kind, shape):
    value = np.resize(GOOD[kind], shape) if math.prod(shape) else np.empty(shape, GOOD[kind].dtype)
    msg = raises_naming("X", DECODERS[kind], {"X": value})
    assert "exactly one value" in msg and str(list(shape)) in msg, msg


def test_an_omitted_input_is_its_default():
    assert I.get_str({}, "PROMPT") is None
    assert I.get_str({}, "PROMPT", "[speed_5]") == "[speed_5]"
    assert I.get_float({}, "TEMPERATURE", 0.3, 0.0, 100.0, lo_open=True) == 0.3
    assert I.get_int({}, "TOP_K", 20, 1, 100) == 20
    assert I.get_bool({}, "USE_DECODER", True) is True
    assert I.get_bool({"USE_DECODER": None}, "USE_DECODER", True) is True
    # defaults are not range-checked: they are the server's, not the client's
    assert I.get_int({}, "MAX_NEW_TOKENS", 0, 1, 10) == 0


# --- text -------------------------------------------------------------------------------------------------------------
def test_text_is_utf8_bytes_or_str():
    assert I.get_str({"TEXT": one("你好 [uv_break]".encode(), object)}, "TEXT") == "你好 [uv_break]"
    assert I.get_str({"TEXT": one(np.bytes_(b"hi"), object)}, "TEXT") == "hi"
    assert I.get_str({"TEXT": one("hi", object)}, "TEXT") == "hi"  # the services driven directly
    assert I.get_str({"TEXT": np.array([["hi"]])}, "TEXT") == "hi"  # numpy str_


def test_an_empty_string_is_read_as_sent_not_as_the_default():
    """Whether empty text is acceptable is the reader's call (preprocess refuses an empty TEXT, naming it)."""
    assert I.get_str({"REFINE_PROMPT": one(b"", object)}, "REFINE_PROMPT", "[oral_2]") == ""
    assert I.get_str({"SPEAKER": one("", object)}, "SPEAKER", None) == ""


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"hi \xc3", b"\xed\xa0\x80", b"\x80abc"])
def test_non_utf8_bytes_are_an_error_naming_the_input(raw):
    msg = raises_naming("SPEAKER", I.get_str, {"SPEAKER": one(raw, object)}, "SPEAKER")
    assert "UTF-8" in msg, msg


@pytest.mark.parametrize("value", [np.int64(5), np.float32(0.5), np.bool_(True), 7, 1.5])
def test_a_number_where_text_is_read_is_an_error_naming_the_input(value):
    msg = raises_naming("TEXT", I.get_str, {"TEXT": one(value, object)}, "TEXT")
    assert "text" in msg, msg


# --- floats -----------------------------------------------------------------------------------------------------------
def test_floats_in_bounds_are_accepted_at_both_ends():
    assert I.get_float({"TOP_P": one(1.0, np.float32)}, "TOP_P", 0.7, 0.0, 1.0, lo_open=True) == 1.0
    assert I.get_float({"TOP_P": one(1e-6, np.float32)}, "TOP_P", 0.7, 0.0, 1.0, lo_open=True) == pytest.approx(1e-6)
    assert I.get_float({"X": one(0.0, np.float32)}, "X", 0.5, 0.0, 1.0) == 0.0  # closed below unless lo_open
    assert I.get_float({"X": one(1, np.int32)}, "X", 0.5, 0.0, 1.0) == 1.0  # an integer is a number
    assert I.get_float({"X": one(0.5, np.float16)}, "X", 0.0, 0.0, 1.0) == 0.5


@pytest.mark.parametrize("value", [NAN, INF, -INF, 0.0, -0.1, 1.0000001, 1e30])
def test_a_float_out_of_bounds_or_not_finite_is_an_error_naming_the_input(value):
    msg = raises_naming("TOP_P", I.get_float, {"TOP_P": one(value, np.float64)}, "TOP_P", 0.7, 0.0, 1.0, lo_open=True)
    assert "(0.0, 1.0]" in msg, msg


def test_an_integer_beyond_any_float_is_out_of_bounds_not_a_crash():
    raises_naming("TEMPERATURE", I.get_float, {"TEMPERATURE": one(10**400, object)}, "TEMPERATURE", 0.3, 0.0, 100.0)


@pytest.mark.parametrize("value", [b"0.5", "0.5", True, np.bool_(False), 1 + 2j])
def test_text_or_a_boolean_where_a_float_is_read_is_an_error_naming_the_input(value):
    msg = raises_naming("TEMPERATURE", I.get_float, {"TEMPERATURE": one(value, object)}, "TEMPERATURE", 0.3, 0.0, 100.0)
    assert "a number" in msg, msg


# --- integers ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16])
def test_integers_of_any_width_are_accepted_at_both_bounds(dtype):
    assert I.get_int({"TOP_K": one(1, dtype)}, "TOP_K", 20, 1, 100) == 1
    assert I.get_int({"TOP_K": one(100, dtype)}, "TOP_K", 20, 1, 100) == 100
    assert type(I.get_int({"TOP_K": one(5, dtype)}, "TOP_K", 20, 1, 100)) is int


@pytest.mark.parametrize("value", [0, -3, 101, 1 << 40])
def test_an_integer_out_of_bounds_is_an_error_naming_the_input(value):
    msg = raises_naming("TOP_K", I.get_int, {"TOP_K": one(value, np.int64)}, "TOP_K", 20, 1, 100)
    assert "[1, 100]" in msg, msg


@pytest.mark.parametrize("value", [np.float32(2.0), np.float32(2.5), NAN, INF, b"3", "3", True, np.bool_(True)])
def test_a_float_text_or_boolean_where_an_integer_is_read_is_an_error_naming_the_input(value):
    """Never truncated (2.5 → 2) nor crashing on int(nan) with a message that names nothing."""
    msg = raises_naming("MAX_NEW_TOKENS", I.get_int, {"MAX_NEW_TOKENS": one(value, object)}, "MAX_NEW_TOKENS",
                        2048, 1, 2048)
    assert "an integer" in msg, msg


# --- booleans ---------------------------------------------------------------------------------------------------------
def test_booleans_are_read_as_sent():
    assert I.get_bool({"REFINE_TEXT": one(True)}, "REFINE_TEXT", False) is True
    assert I.get_bool({"USE_DECODER": one(False)}, "USE_DECODER", True) is False
    assert I.get_bool({"USE_DECODER": one(False, object)}, "USE_DECODER", True) is False


@pytest.mark.parametrize("value", [b"false", "false", b"", 0, 1, np.int32(1), 0.0, NAN])
def test_anything_but_a_boolean_where_a_boolean_is_read_is_an_error_naming_the_input(value):
    """bool(b"false") is True: a silent misreading, so any other kind is refused."""
    msg = raises_naming("USE_DECODER", I.get_bool, {"USE_DECODER": one(value, object)}, "USE_DECODER", True)
    assert "a boolean" in msg, msg


# --- SEED -------------------------------------------------------------------------------------------------------------
def test_a_seed_is_any_64_bit_integer_and_random_when_omitted():
    for seed in (0, -(1 << 63), (1 << 63) - 1):
        assert I.get_seed({"SEED": one(seed, np.int64)}) == seed
    drawn = {I.get_seed({}) for _ in range(8)}
    assert len(drawn) > 1 and all(0 <= s < (1 << 63) for s in drawn)


@pytest.mark.parametrize("value", [1.0, NAN, INF, b"1", True, 1 << 63, -(1 << 63) - 1])
def test_a_seed_of_the_wrong_kind_or_beyond_64_bits_is_an_error_naming_it(value):
    raises_naming("SEED", I.get_seed, {"SEED": one(value, object)})


def test_a_seed_of_a_wrong_shape_is_an_error_naming_it():
    raises_naming("SEED", I.get_seed, {"SEED": np.array([[1, 2, 3]], np.int64)})


# --- the sampling inputs together -------------------------------------------------------------------------------------
def test_sampling_params_defaults_are_upstreams():
    p = I.sampling_params({"SEED": one(7, np.int64)}, InferCodeParams)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (
        InferCodeParams.temperature, InferCodeParams.top_P, InferCodeParams.top_K, InferCodeParams.repetition_penalty)
    assert (p.max_new_tokens, p.min_new_tokens, p.seed) == (InferCodeParams.max_new_token,
                                                            InferCodeParams.min_new_token, 7)
    # a smaller engine limit caps the default rather than refusing it
    assert I.sampling_params({"SEED": one(7, np.int64)}, InferCodeParams, max_new_limit=16).max_new_tokens == 16


def test_sampling_params_read_every_override():
    inputs = {"TEMPERATURE": one(100.0, np.float32), "TOP_P": one(1.0, np.float32), "TOP_K": one(1 << 30, np.int32),
              "REPETITION_PENALTY": one(2.0, np.float32), "MAX_NEW_TOKENS": one(6, np.int32),
              "MIN_NEW_TOKENS": one(6, np.int32), "SEED": one(-1, np.int64)}
    p = I.sampling_params(inputs, InferCodeParams)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_new_tokens, p.min_new_tokens, p.seed) == (
        100.0, 1.0, 1 << 30, 2.0, 6, 6, -1)


SAMPLING_BAD = [
    ("TEMPERATURE", one(0.0, np.float32)), ("TEMPERATURE", one(100.5, np.float32)),
    ("TEMPERATURE", one(NAN, np.float32)),
    ("TOP_P", one(-INF, np.float32)), ("TOP_P", one(1.5, np.float32)), ("TOP_P", one(b"0.5", object)),
    ("TOP_K", one(0, np.int32)), ("TOP_K", one((1 << 30) + 1, np.int64)), ("TOP_K", one(2.0, np.float32)),
    ("REPETITION_PENALTY", one(0.0, np.float32)), ("REPETITION_PENALTY", one(INF, np.float32)),
    ("MAX_NEW_TOKENS", one(0, np.int32)), ("MAX_NEW_TOKENS", one(LIMITS.max_new_tokens + 1, np.int32)),
    ("MIN_NEW_TOKENS", one(-1, np.int32)), ("MIN_NEW_TOKENS", one(LIMITS.max_new_tokens + 1, np.int32)),
    ("SEED", one(0.5, np.float64)), ("SEED", np.array([[1, 2]], np.int64)),
    ("TEMPERATURE", np.array([[0.3, 0.3]], np.float32)),
]


@pytest.mark.parametrize("name,value", SAMPLING_BAD, ids=[f"{n}{i}" for i, (n, _) in enumerate(SAMPLING_BAD)])
def test_sampling_params_name_the_bad_input(name, value):
    raises_naming(name, I.sampling_params, {name: value}, InferCodeParams)


def test_max_new_tokens_is_bounded_by_the_engines_limit():
    msg = raises_naming("MAX_NEW_TOKENS", I.sampling_params, {"MAX_NEW_TOKENS": one(17, np.int32)}, InferCodeParams,
                        max_new_limit=16)
    assert "[1, 16]" in msg, msg


def test_min_new_tokens_above_max_new_tokens_names_both():
    inputs = {"MAX_NEW_TOKENS": one(4, np.int32), "MIN_NEW_TOKENS": one(5, np.int32)}
    msg = raises_naming("MIN_NEW_TOKENS", I.sampling_params, inputs, InferCodeParams)
    assert "MAX_NEW_TOKENS" in msg, msg


# --- refine-text inputs -----------------------------------------------------------------------------------------------
def test_refine_params_are_the_refine_inputs_under_plain_names():
    inputs = {"TEXT": one(b"hi", object), "REFINE_TEXT": one(True), "REFINE_PROMPT": one(b"[oral_2]", object),
              "REFINE_TEMPERATURE": one(0.5, np.float32), "REFINE_TOP_K": one(5, np.int32),
              "TEMPERATURE": one(0.1, np.float32)}
    params = I.refine_params(inputs)
    assert sorted(params) == ["TEMPERATURE", "TOP_K"]
    assert params["TEMPERATURE"] is inputs["REFINE_TEMPERATURE"] and params["TOP_K"] is inputs["REFINE_TOP_K"]
    assert I.refine_params({}) == {}


REFINE_BAD = [
    ("REFINE_TEMPERATURE", one(NAN, np.float32)), ("REFINE_TEMPERATURE", one(-1.0, np.float32)),
    ("REFINE_TOP_P", one(INF, np.float32)), ("REFINE_TOP_P", one(b"x", object)), ("REFINE_TOP_K", one(0, np.int32)),
    ("REFINE_TOP_K", one(1.5, np.float32)), ("REFINE_REPETITION_PENALTY", one(0.0, np.float32)),
    ("REFINE_MAX_NEW_TOKENS", one(0, np.int32)), ("REFINE_MAX_NEW_TOKENS", one(LIMITS.max_new_tokens + 1, np.int32)),
    ("REFINE_TOP_K", np.array([[1, 2]], np.int32)),
]


@pytest.mark.parametrize("name,value", REFINE_BAD, ids=[f"{n}{i}" for i, (n, _) in enumerate(REFINE_BAD)])
def test_refine_params_name_the_refine_input_at_fault(name, value):
    raises_naming(name, I.refine_params, {name: value})


def test_refine_request_carries_the_ids_and_the_refine_flag():
    req = I.refine_request(np.arange(5, dtype=np.int32), {"TOP_K": one(5, np.int32)})
    assert req["TEXT_IDS"].dtype == np.int64 and req["TEXT_IDS"].shape == (1, 5)
    assert req["REFINE"].tolist() == [[True]] and req["TOP_K"].tolist() == [[5]]
    p = I.sampling_params(req, RefineTextParams)  # what the GPT model reads of it
    assert p.top_k == 5 and I.get_bool(req, "REFINE", False) is True


# --- named: a decoder's error names the contract input ----------------------------------------------------------------
def test_named_prefixes_the_input_unless_the_message_already_names_it():
    def bad(msg):
        raise InputError(msg)

    with pytest.raises(InputError, match=r"^SPEAKER: not a speaker string$"):
        I.named("SPEAKER", bad, "not a speaker string")
    with pytest.raises(InputError, match=r"^SPEAKER must be short$"):
        I.named("SPEAKER", bad, "SPEAKER must be short")
    assert I.named("VOICE", lambda a, b: a + b, 1, 2) == 3


def test_named_leaves_other_errors_alone():
    """A bug is not the client's fault: it is not dressed up as an input error."""
    def boom():
        raise KeyError("k")

    with pytest.raises(KeyError):
        I.named("TEXT", boom)


def test_input_error_is_a_value_error_the_backend_answers_as_invalid_argument():
    assert issubclass(InputError, ValueError)
