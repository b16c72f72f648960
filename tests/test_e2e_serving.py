"""The `chattts` ensemble served by a real tritonserver (python backend), over gRPC and HTTP."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from chattts_triton.config import (
    GPT,
    HOP_LENGTH,
    SAMPLE_RATE,
    samples_for_codes,
)
from chattts_triton.triton import repo_config as rc
from tests.reliability_util import contract_inputs
from tests.spoken_cases import EN_CASES, ZH_CASES

pytestmark = pytest.mark.e2e

inputs = contract_inputs


def synth(server, protocol="grpc", **values) -> np.ndarray:
    if protocol == "grpc":
        c = grpcclient.InferenceServerClient(server.grpc_url)
        return c.infer("chattts", inputs(grpcclient, **values)).as_numpy("AUDIO")[0]
    c = httpclient.InferenceServerClient(server.http_url)
    return c.infer("chattts", inputs(httpclient, **values)).as_numpy("AUDIO")[0]


def test_forced_length_gives_exactly_that_many_samples(served_tiny):
    for n in (1, 7, 40):
        audio = synth(served_tiny, TEXT="你好", MIN_NEW_TOKENS=n, MAX_NEW_TOKENS=n, SEED=1)
        assert audio.dtype == np.float32 and audio.shape == (samples_for_codes(n),)
        assert np.isfinite(audio).all()
    assert samples_for_codes(40) == HOP_LENGTH * 79 and SAMPLE_RATE == 24000


def test_concurrent_texts_equal_their_single_request_output(served_tiny):
    texts = ["你好。", "今天天气很好，我们去公园散步吧。", "hello world",
             "四川美食确实以辣闻名，但也有不辣的选择，比如甜水面、赖汤圆。", "好", "the weather is good today"]
    kw = [dict(TEXT=t, SEED=100 + i, MAX_NEW_TOKENS=24 + 8 * i) for i, t in enumerate(texts)]
    alone = [synth(served_tiny, **k) for k in kw]
    with concurrent.futures.ThreadPoolExecutor(len(kw)) as pool:
        together = list(pool.map(lambda k: synth(served_tiny, **k), kw))
    for a, b in zip(alone, together, strict=True):
        # same tokens; batched matmuls may round differently in the last bits
        assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5
    assert len({a.tobytes() for a in alone}) == len(alone)


def _multi_request_executions(client, model: str) -> int:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return sum(int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", []) if int(b["batch_size"]) > 1)


def test_vocoder_batches_utterances_of_different_lengths(served_tiny):
    """Real traffic has utterances of every length; Triton's batcher must still give the vocoder several at
    once (allow_ragged_batch), each answered with its own length."""
    client = grpcclient.InferenceServerClient(served_tiny.grpc_url)
    before = _multi_request_executions(client, rc.VOCODER)
    dims = {i.name: list(i.dims) for i in client.get_model_config(rc.VOCODER).config.input}
    h = dims["HIDDENS"][-1]

    def vocode(frames: int) -> int:
        c = grpcclient.InferenceServerClient(served_tiny.grpc_url)
        codes = grpcclient.InferInput("CODES", [1, frames, 4], "INT64")
        codes.set_data_from_numpy(np.zeros((1, frames, 4), np.int64))
        hid = grpcclient.InferInput("HIDDENS", [1, frames, h], "FP32")
        hid.set_data_from_numpy(np.zeros((1, frames, h), np.float32))
        return c.infer(rc.VOCODER, [codes, hid]).as_numpy("AUDIO").shape[-1]

    frames = [300 + 7 * i for i in range(48)]  # all different
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        lengths = list(pool.map(vocode, frames))
    assert lengths == [samples_for_codes(n) for n in frames]
    assert _multi_request_executions(client, rc.VOCODER) > before


def test_every_optional_input_over_grpc_and_http(served_tiny):
    from chattts_triton.model.speaker import encode_prompt, sample_random_speaker

    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    reference = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    hidden = rc.read_manifest(served_tiny.model_repository)["arch"]["gpt"]["hidden"]
    full = dict(
        TEXT="今天天气很好[uv_break]。", SPEAKER=sample_random_speaker(7, hidden), SEED=5, TEMPERATURE=0.5, TOP_P=0.8,
        TOP_K=10, REPETITION_PENALTY=1.1, MAX_NEW_TOKENS=30, MIN_NEW_TOKENS=5, PROMPT="[speed_3]", REFINE_TEXT=True,
        REFINE_PROMPT="[oral_2][laugh_0][break_6]", REFINE_TEMPERATURE=0.7, REFINE_TOP_P=0.7, REFINE_TOP_K=20,
        REFINE_REPETITION_PENALTY=1.0, REFINE_MAX_NEW_TOKENS=12, USE_DECODER=False, NORMALIZE_TEXT=False,
        SPEAKER_AUDIO=reference, SPEAKER_TEXT="参考音频的文本",
    )
    a = synth(served_tiny, "grpc", **full)
    b = synth(served_tiny, "http", **full)
    assert a.size > 0 and np.isfinite(a).all() and np.array_equal(a, b)
    # a reference speaker as a spk_smp string equals the same speaker given as audio
    sample = encode_prompt(np.random.default_rng(0).integers(0, 625, (4, 30)))
    c = synth(served_tiny, TEXT="你好", SPEAKER_SAMPLE=sample, SPEAKER_TEXT="参考", SEED=1, MAX_NEW_TOKENS=10)
    assert c.size > 0
    # each option changes what is generated
    base = dict(TEXT="你好世界", SEED=9, MAX_NEW_TOKENS=20, MIN_NEW_TOKENS=20)
    ref = synth(served_tiny, **base)
    for k, v in dict(SEED=10, TEMPERATURE=1.5, PROMPT="[speed_9]", USE_DECODER=False).items():
        assert not np.array_equal(synth(served_tiny, **{**base, k: v}), ref), k


BAD = [
    (dict(TEXT=""), "TEXT"),
    (dict(TEXT="   "), "TEXT"),
    (dict(TEXT=b"\xff\xfe bad utf-8"), "UTF-8"),
    (dict(TEXT="a\x00b"), "TEXT"),
    (dict(TEXT="x" * 5000), "TEXT"),
    (dict(TEXT="hi [not_a_token]"), "not_a_token"),
    (dict(TEXT="hi", SPEAKER="not a speaker"), "SPEAKER"),
    (dict(TEXT="hi", TEMPERATURE=0.0), "TEMPERATURE"),
    (dict(TEXT="hi", TEMPERATURE=float("nan")), "TEMPERATURE"),
    (dict(TEXT="hi", TOP_P=1.5), "TOP_P"),
    (dict(TEXT="hi", TOP_K=0), "TOP_K"),
    (dict(TEXT="hi", MAX_NEW_TOKENS=5, MIN_NEW_TOKENS=9), "MIN_NEW_TOKENS"),
    (dict(TEXT="hi", MAX_NEW_TOKENS=100000), "MAX_NEW_TOKENS"),
    (dict(TEXT="hi", PROMPT="[speed_99]"), "PROMPT"),
    (dict(TEXT="hi", SPEAKER_AUDIO=np.full(4800, np.inf, np.float32)), "SPEAKER_AUDIO"),
    (dict(TEXT="hi", SPEAKER_SAMPLE="garbage"), "SPEAKER_SAMPLE"),
    (dict(TEXT="hi", VOICE="no-such-voice"), "VOICE"),
]


@pytest.mark.parametrize("values,word", BAD, ids=[w + str(i) for i, (_, w) in enumerate(BAD)])
def test_bad_input_gets_invalid_argument(served_tiny, values, word):
    with pytest.raises(InferenceServerException) as e:
        synth(served_tiny, **values)
    assert "INVALID_ARG" in str(e.value.status()) or "400" in str(e.value.status())
    assert word.lower() in e.value.message().lower()


def test_bad_request_leaves_batchmates_and_server_unaffected(served_tiny):
    good = dict(TEXT="你好", SEED=3, MAX_NEW_TOKENS=12)
    expected = synth(served_tiny, **good)
    jobs = [good, dict(TEXT="", SEED=3), good, dict(TEXT="hi", TOP_K=-1), good]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(synth, served_tiny, **j) for j in jobs]
    for j, f in zip(jobs, futures, strict=True):
        if j is good:
            assert np.abs(f.result() - expected).max() <= 1e-5
        else:
            with pytest.raises(InferenceServerException):
                f.result()
    wrong_dtype = grpcclient.InferInput("TEXT", [1, 1], "INT32")
    wrong_dtype.set_data_from_numpy(np.array([[1]], np.int32))
    with pytest.raises(InferenceServerException):
        grpcclient.InferenceServerClient(served_tiny.grpc_url).infer("chattts", [wrong_dtype])
    assert grpcclient.InferenceServerClient(served_tiny.grpc_url).is_server_ready()
    assert np.abs(synth(served_tiny, **good) - expected).max() <= 1e-5


# --- SPOKEN_TEXT: what the server voices --------------------------------------------------------
# every case of the hand-written tables over gRPC (tests/test_spoken.py reads them through the function too),
# a representative subset over HTTP
SERVED_CASES = [c for c in ZH_CASES if c[0] in (
    "我有3个苹果，价格是12.5元，增长了45%。", "2个人", "3/4的学生", "气温-3.5℃", "共计¥1,234.56", "日期是2026-12-02",
    "下午3:30见", "休息3-5天", "电话13812345678", "第22届", "内存16GB", "你好[uv_break]我有3本书[laugh_0]",
)] + [c for c in EN_CASES if c[0] in (
    "Meet me at 10:30 on 2026-12-02, it costs $12.50.", "There are 1234 people.", "About 3/4 of them agreed.",
    "The result is -7.", "A coffee is £2.50.", "Music of the 1990s.", "Wait 3-5 days.", "Call 555-123-4567.",
    "On the 23rd floor.", "I ran 5 km.", "Hello [uv_break] I have 2 cats [laugh_0].",
)]


def spoken(server, protocol="grpc", **values) -> str:
    module = grpcclient if protocol == "grpc" else httpclient
    c = module.InferenceServerClient(server.grpc_url if protocol == "grpc" else server.http_url)
    outputs = [module.InferRequestedOutput("AUDIO"), module.InferRequestedOutput("SPOKEN_TEXT")]
    result = c.infer("chattts", inputs(module, **values), outputs=outputs)
    text = result.as_numpy("SPOKEN_TEXT")
    assert text.shape == (1, 1) and result.as_numpy("AUDIO").shape[0] == 1
    return text[0, 0].decode("utf-8")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_spoken_text_shows_what_is_voiced_over_grpc_and_http(served_tiny, protocol):
    from chattts_triton.model.text import Normalizer
    from tests.test_spoken import same_speech

    assert len(SERVED_CASES) == 23
    cases = ZH_CASES + EN_CASES if protocol == "grpc" else SERVED_CASES
    assert len(cases) >= 23 and (protocol == "http" or (len(ZH_CASES) >= 60 and len(EN_CASES) >= 60))
    upstream_step = Normalizer()  # the hand-written spoken form through upstream's punctuation/homophone step

    def check(case):
        written, accepted = case
        got = spoken(served_tiny, protocol, TEXT=written, SEED=1, MAX_NEW_TOKENS=2)
        return None if any(same_speech(got, upstream_step(e)) for e in accepted) else (written, got)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bad = [b for b in pool.map(check, cases) if b]
    assert not bad
    # without normalisation the GPT reads the text as sent
    assert spoken(served_tiny, protocol, TEXT="It costs $12.50.", NORMALIZE_TEXT=False,
                  MAX_NEW_TOKENS=2) == "It costs $12.50."


def test_removed_characters_are_counted_per_model_and_a_text_removed_entirely_is_named(served_tiny):
    import time
    import urllib.request

    def removed():
        with urllib.request.urlopen(served_tiny.metrics_url, timeout=5) as r:
            return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                       if line.startswith("chattts_text_removed_chars{") and 'model="chattts_preprocess"' in line)

    time.sleep(0.6)  # the gauges refresh every 0.25 s
    before = removed()
    assert spoken(served_tiny, TEXT="你好😀世界😀", MAX_NEW_TOKENS=2) == "你好世界"
    time.sleep(0.6)
    assert removed() == before + 2
    with pytest.raises(InferenceServerException) as e:
        synth(served_tiny, TEXT="😀🎉")
    assert "INVALID_ARG" in str(e.value.status()) and "U+1F600" in e.value.message() and "U+1F389" in e.value.message()


# --- parity with upstream ChatTTS on the same full-size weights ---------------------------------
def upstream_raw_wav(chat, text, spk, use_decoder, n_max, n_min):
    """Upstream `Chat._infer` (what `Chat.infer` strips afterwards), batch of one."""
    params = chat.InferCodeParams(spk_emb=spk, temperature=1e-5, max_new_token=n_max, min_new_token=n_min,
                                  show_tqdm=False)
    gen = chat._infer([text], False, None, True, False, use_decoder, True, True, False, 4,
                      chat.RefineTextParams(), params)
    return next(gen)[0], params


@pytest.mark.slow
@pytest.mark.parametrize("use_decoder", [True, False])
def test_served_audio_equals_upstream_chat_infer(served_full, upstream_full, use_decoder):
    import torch

    chat = upstream_full
    torch.manual_seed(0)
    spk = chat.sample_random_speaker()
    text = "四川美食确实以辣闻名，但也有不辣的选择。"
    raw, params = upstream_raw_wav(chat, text, spk, use_decoder, 60, 20)
    ours = synth(served_full, TEXT=text, SPEAKER=spk, TEMPERATURE=1e-5, MAX_NEW_TOKENS=60, MIN_NEW_TOKENS=20,
                 USE_DECODER=use_decoder, SEED=0)
    assert ours.shape == raw.shape
    assert np.abs(ours - raw).max() <= 1e-3
    # Chat.infer additionally drops every sample with |x| <= 1e-5 (upstream's trim)
    stripped = chat.infer(text, skip_refine_text=True, split_text=False, use_decoder=use_decoder,
                          params_infer_code=params)[0]
    ours_stripped = ours[np.abs(ours) > 1e-5]
    assert ours_stripped.shape == stripped.shape and np.abs(ours_stripped - stripped).max() <= 1e-3


def test_int8_cpu_repository_serves(tiny_assets, tmp_path, served_tiny):
    """The opt-in int8 CPU mode: dynamic int8 linears in the GPT, everything else fp32."""
    import torch

    from chattts_triton.launcher.tritonserver import TritonServer
    from export.__main__ import export_repository

    repo = export_repository(tiny_assets, tmp_path / "int8", ["torchscript"], dtype="int8", progress=lambda m: None)
    gpt = torch.jit.load(str(repo / GPT / "1" / "gpt.pt"))
    linear = dict(gpt.named_modules())["layers.0.q_proj"]
    assert "_packed_params" in dict(linear.named_modules())  # an int8 dynamically quantised linear
    with TritonServer(repo, log_file=tmp_path / "int8.log", startup_timeout_s=300) as server:
        kw = dict(TEXT="你好世界", SEED=4, MAX_NEW_TOKENS=16, MIN_NEW_TOKENS=16)
        audio = synth(server, **kw)
        assert audio.shape == (samples_for_codes(16),) and np.isfinite(audio).all()
    assert synth(served_tiny, **kw).shape == audio.shape


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_half_precision_repository_serves_through_the_launcher(tiny_assets, tmp_path, dtype):
    """What a GPU export writes (fp16 for cards before Ampere, bf16 after), served by the launcher: the GPT's
    weights are in that precision, and the ensemble answers with finite float32 audio of the forced length
    (the GPU's own half-precision path: tests/test_gpu.py)."""
    import torch

    from chattts_triton.launcher.serve import Launched
    from export.__main__ import export_repository

    repo = export_repository(tiny_assets, tmp_path / dtype, ["torchscript"], dtype=dtype, progress=lambda m: None)
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    gpt = torch.jit.load(str(repo / GPT / "1" / "gpt.pt"))
    assert {p.dtype for p in gpt.parameters()} == {half}
    with Launched(repo, tmp_path / "server.log") as server:
        audio = synth(server, TEXT="你好世界", SEED=4, MAX_NEW_TOKENS=16, MIN_NEW_TOKENS=16)
        assert server.restarts == 0
    assert audio.dtype == np.float32 and audio.shape == (samples_for_codes(16),) and np.isfinite(audio).all()
