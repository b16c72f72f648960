"""Streaming: windowed decoding exactness (the plan itself: tests/test_chunks.py), the stream service without Triton,
and `chattts_stream` through the real tritonserver (gRPC bidirectional streaming, HTTP SSE, cancel)."""

from __future__ import annotations

import json
import queue
import random
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from chattts_triton.config import ENSEMBLE, NUM_VQ, SAMPLES_PER_CODE, STREAM, TINY_ARCH, samples_for_codes
from chattts_triton.model.chunks import ChunkPlanner, chunk_samples, fade_in
from chattts_triton.model.codec import ConvNeXtBlock, load_codecs, stream_lookahead_codes
from chattts_triton.runtime.streaming import Cancelled, StreamCall
from chattts_triton.runtime.vocoder import VocoderService
from tests.reliability_util import wait_for

TEXT = "你好，欢迎使用流式合成。"


# --- windowed decoding against the whole-utterance decode ----------------------------------------
class _Net:
    """An artifact stand-in over an in-memory module (VocoderService calls artifacts like this)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args):
        with torch.inference_mode():
            return self.module(*args)


def _vocoder(assets, layer_scale: float) -> VocoderService:
    """The real VocoderService.synthesize over the tiny codecs, with every ConvNeXt layer scale
    raised: upstream initialises the decoders' to 1e-6, which would hide their receptive field."""
    nets = load_codecs(assets, names=("decoder", "dvae_decode", "vocos"))
    g = torch.Generator().manual_seed(1)
    for net in nets.values():
        for m in net.modules():
            if isinstance(m, ConvNeXtBlock):
                m.weight.data = layer_scale * (0.5 + torch.rand(m.weight.shape, generator=g))
    voc = VocoderService.__new__(VocoderService)
    voc.arch, voc.device, voc.graphs = TINY_ARCH, torch.device("cpu"), None
    voc.decoder, voc.dvae, voc.vocos = _Net(nets["decoder"]), _Net(nets["dvae_decode"]), _Net(nets["vocos"])
    voc.graph_nets = (voc.decoder, voc.dvae, voc.vocos)
    return voc


def _streamed(voc, x, use_decoder, look, first=3, chunk=7, first_look=None, fade=0, windows=None):
    """The stream StreamService sends for frames x arriving one by one (its planner and chunk_samples);
    `windows` collects (window, decoded audio)."""
    planner = ChunkPlanner(first, chunk, look, first_look, fade, exact=stream_lookahead_codes(TINY_ARCH))
    out, held = [], None
    for n in range(1, x.shape[0] + 2):
        w = planner.next(min(n, x.shape[0]), n > x.shape[0])
        if w is not None:
            audio = voc.synthesize([(use_decoder, x[w.start:w.stop])])[0]
            chunk, held = chunk_samples(w, audio, held)
            out.append(chunk)
            if windows is not None:
                windows.append((w, audio))
    return np.concatenate(out), len(out)


@pytest.mark.parametrize("use_decoder", [True, False])
def test_windowed_decode_equals_the_whole_decode_only_with_the_full_lookahead(tiny_assets, use_decoder):
    voc = _vocoder(tiny_assets, layer_scale=0.5)
    g = torch.Generator().manual_seed(3)
    n = 90
    x = torch.randn(n, TINY_ARCH.gpt.hidden, generator=g) if use_decoder else torch.randint(0, 625, (n, 4), generator=g)
    whole = voc.synthesize([(use_decoder, x)])[0]
    look = stream_lookahead_codes(TINY_ARCH)
    streamed, chunks = _streamed(voc, x, use_decoder, look)
    assert chunks > 5 and streamed.shape == whole.shape
    assert np.abs(streamed - whole).max() <= 1e-5
    short, _ = _streamed(voc, x, use_decoder, max(1, look // 3))
    assert np.abs(short - whole).max() > 1e-4  # less context changes the seams: the radius is real


@pytest.mark.parametrize("use_decoder", [True, False])
def test_short_first_lookahead_fades_into_the_exact_stream_within_the_stated_bounds(tiny_assets, use_decoder):
    """The first chunk is the first window's decode (fewer frames to its right than the whole decode
    sees); its held frames fade into the second window's; everything after equals the whole decode.
    Bounds: in the fade every sample is a convex blend of the two windows' decodes, so its error is at
    most the larger of theirs, and between consecutive samples the stream moves by at most what one of
    the two decodes moves plus π / (2K) times their difference (K: faded samples)."""
    voc = _vocoder(tiny_assets, layer_scale=0.5)
    g = torch.Generator().manual_seed(3)
    n, first, fade, S = 90, 3, 2, SAMPLES_PER_CODE
    x = torch.randn(n, TINY_ARCH.gpt.hidden, generator=g) if use_decoder else torch.randint(0, 625, (n, 4), generator=g)
    whole = voc.synthesize([(use_decoder, x)])[0]
    look = stream_lookahead_codes(TINY_ARCH)
    wins = []
    streamed, chunks = _streamed(voc, x, use_decoder, look, first=first, chunk=7, first_look=3, fade=fade, windows=wins)
    assert chunks > 5 and streamed.shape == whole.shape

    def placed(w, audio):  # a window's decode at its place in the utterance (NaN outside it)
        out = np.full(whole.shape, np.nan, np.float32)
        out[w.start * S:w.start * S + audio.shape[0]] = audio
        return out

    a, b = placed(*wins[0]), placed(*wins[1])
    seam, k = first * S, fade * S
    assert [w.hold for w, _ in wins] == [k] + [0] * (len(wins) - 1)  # only the approximate first window holds
    assert np.abs(streamed[:seam] - a[:seam]).max() <= 1e-6  # the first chunk is the first window's decode
    assert np.abs(streamed[:seam] - whole[:seam]).max() > 1e-4  # ... which is an approximation here
    assert np.abs(streamed[seam + k:] - whole[seam + k:]).max() <= 1e-5  # exact after the fade
    wt = fade_in(k)
    assert np.abs(streamed[seam:seam + k] - ((1 - wt) * a[seam:seam + k] + wt * b[seam:seam + k])).max() <= 1e-6
    err = np.abs(streamed - whole)[seam:seam + k]
    assert (err <= np.maximum(np.abs(a - whole), np.abs(b - whole))[seam:seam + k] + 1e-6).all()
    i = np.arange(seam, seam + k + 1)  # every step into, inside and out of the fade
    step = np.abs(streamed[i] - streamed[i - 1])
    # past the fade only b's step counts (fmax skips the NaN where a has ended)
    bound = np.fmax(np.abs(a[i] - a[i - 1]), np.abs(b[i] - b[i - 1])) + np.pi / (2 * k) * np.abs(b[i - 1] - a[i - 1])
    assert (step <= bound + 1e-6).all()


def test_stream_error_bench_measures_the_first_chunk_against_the_whole_decode(tiny_repo, tmp_path):
    from bench.probes import stream_error

    out = tmp_path / "err"
    argv = ["--repo", str(tiny_repo), "--first-lookahead", "1,0", "--fade", "1", "--first-chunk", "3", "--chunk", "7",
            "--tokens", "40", "--seeds", "1", "--out", str(out)]
    assert stream_error.main(argv + ["--layer-scale", "0.5"]) == 0
    rows = json.loads((tmp_path / "err.json").read_text())["rows"]
    assert [r["first_chunk_after_frames"] for r in rows] == [4, 3 + stream_lookahead_codes(TINY_ARCH)]
    assert rows[0]["first_chunk_max_err"] > 1e-3 and rows[0]["first_chunk_snr_db"] < 40  # one frame of lookahead
    assert rows[1]["first_chunk_max_err"] <= 1e-5 and rows[1]["fade_max_err"] <= 1e-5  # exact
    assert "| 1 | 0 | 4 |" in (tmp_path / "err.md").read_text()  # a fade must be shorter than the lookahead


def test_stream_codec_bench_times_a_streams_windows_alone_and_beside_the_generating_engine(tiny_repo, tmp_path):
    from bench.probes import stream_codec

    out = tmp_path / "codec.json"
    assert stream_codec.main(["--repo", str(tiny_repo), "--device", "cpu", "--tokens", "40", "--repeats", "1",
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    sizes = res["windows"]
    assert len(sizes) >= 2 and max(sizes) <= 40  # the planner's windows of one 40-frame stream
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"alone", "beside_engine", "alone_codec_eager", "beside_engine_codec_eager", "alone_again"}
    for name, r in rows.items():
        assert len(r["call_ms_p50_per_window"]) == len(sizes) and r["call_ms_p50"] > 0
        assert (r["engine_step_ms"] is None) == name.startswith("alone")  # the engine stepped only beside
    assert rows["beside_engine"]["engine_step_device_ms"] <= rows["beside_engine"]["engine_step_ms"]


@pytest.mark.parametrize("use_decoder", [True, False])
def test_codec_graph_buckets_give_each_item_its_eager_batch_audio(tiny_assets, monkeypatch, use_decoder):
    """CodecGraphs' padding (zero frames up to the frame bucket, one-frame rows up to the batch
    bucket), run eagerly here (capture=False): each item gets the audio the eager batch gives it. A
    group over CODEC_GRAPH_FRAMES padded frames runs eagerly, an empty item gets empty audio."""
    from chattts_triton.runtime import vocoder
    from chattts_triton.runtime.vocoder import CodecGraphs

    voc = _vocoder(tiny_assets, 0.1)
    g = torch.Generator().manual_seed(4)

    def item(n, path=use_decoder):
        if path:
            return path, torch.randn(n, TINY_ARCH.gpt.hidden, generator=g) * 0.5
        return path, torch.randint(0, TINY_ARCH.num_audio_tokens - 1, (n, NUM_VQ), generator=g)

    items = [item(n) for n in (5, 17, 9)]
    want = voc.synthesize(items)
    voc.graphs = CodecGraphs(voc, capture=False)
    got = voc.synthesize(items)
    assert [a.shape for a in got] == [a.shape for a in want] == [(samples_for_codes(n),) for n in (5, 17, 9)]
    for a, b in zip(got, want, strict=True):
        assert np.abs(a - b).max() <= 1e-5
    key = ("decoder" if use_decoder else "dvae", 4, 32)
    assert list(voc.graphs.graphs) == [key]
    long = item(vocoder.CODEC_GRAPH_ITEM_FRAMES + 1)  # longer than graphs go: eager
    assert [a.shape for a in voc.synthesize([long])] == [(samples_for_codes(long[1].shape[0]),)]
    assert list(voc.graphs.graphs) == [key]
    monkeypatch.setattr(vocoder, "CODEC_GRAPH_FRAMES", 64)
    eager = [item(40), item(3)]  # one group of 2 x 64 padded frames: over the limit
    assert [a.shape for a in voc.synthesize(eager)] == [(samples_for_codes(40),), (samples_for_codes(3),)]
    assert [a.shape for a in voc.synthesize([item(3), item(0)])] == [(samples_for_codes(3),), (0,)]
    assert set(voc.graphs.graphs) == {key, (key[0], 1, 4)}  # the oversized group made none


def test_codec_graphs_of_the_networks_through_torch_compile_give_the_artifacts_audio(tiny_assets, monkeypatch):
    """--codec-compile: the graphs replay the artifacts' networks rebuilt as plain modules through torch.compile
    (traced by dynamo and run as traced here, capture=False): no depthwise (grouped) convolution is left in the
    traced graphs (`depthwise_as_sum` in its place); after the start-up warm-up, calls of other batch and frame
    buckets compile nothing more; each item of both paths gets the audio the artifacts give it."""
    traced = []

    def record(gm, example_inputs):  # a torch.compile backend: keep the graph, run it as traced
        traced.append(gm)
        return gm.forward

    torch._dynamo.reset()
    voc = _vocoder(tiny_assets, 0.1)  # layer scales raised: the depthwise convolutions shape the audio
    g = torch.Generator().manual_seed(9)
    items = [(True, torch.randn(n, TINY_ARCH.gpt.hidden, generator=g) * 0.5) for n in (5, 17)]
    items += [(False, torch.randint(0, TINY_ARCH.num_audio_tokens - 1, (n, NUM_VQ), generator=g)) for n in (4, 11)]
    want = voc.synthesize_eager(items)
    voc.compile_graphs(backend=record, capture=False)
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    got = voc.synthesize(items) + voc.synthesize(items[:1]) + voc.synthesize(items[1:2] * 9)
    want += want[:1] + want[1:2] * 9
    convs = [n.args[6] for gm in traced for n in gm.graph.nodes if n.target is torch.conv1d]
    assert convs and set(convs) == {1}  # the other convolutions are traced as such; none grouped
    assert [a.shape for a in got] == [a.shape for a in want]
    for a, b in zip(got, want, strict=True):
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, float(np.abs(b).max()))
    torch._dynamo.reset()


def test_a_codec_compile_failing_at_start_up_names_the_setting(tiny_assets):
    """A torch.compile that fails while the codec warms up (at start-up, not in a client's call) is refused
    with an error naming codec_compile and its flag, the compiler's own error chained."""
    def broken(gm, example_inputs):
        raise NotImplementedError("no kernel for this op")

    torch._dynamo.reset()
    voc = _vocoder(tiny_assets, 0.1)
    with pytest.raises(RuntimeError, match=r"(?s)codec_compile \(--codec-compile\).*no kernel for this op") as e:
        voc.compile_graphs(backend=broken, capture=False)
    assert e.value.__cause__ is not None
    torch._dynamo.reset()


def test_a_codec_call_of_many_items_and_both_paths_replays_graphs_of_similar_lengths(tiny_assets):
    """A call of more items than CODEC_GRAPH_BATCH (the stream model decodes every due window of its
    streams in one call), of both paths and with an empty item: per path, groups of at most
    CODEC_GRAPH_BATCH items sorted by length, each item with the audio it gets alone."""
    from chattts_triton.runtime.vocoder import CODEC_GRAPH_BATCH, CodecGraphs

    voc = _vocoder(tiny_assets, 0.1)
    g = torch.Generator().manual_seed(7)
    lens = [int(n) for n in torch.randint(1, 140, (2 * CODEC_GRAPH_BATCH + 3,), generator=g)] + [0]
    items = []
    for j, n in enumerate(lens):
        if j % 3:
            items.append((True, torch.randn(n, TINY_ARCH.gpt.hidden, generator=g) * 0.5))
        else:
            items.append((False, torch.randint(0, TINY_ARCH.num_audio_tokens - 1, (n, NUM_VQ), generator=g)))
    alone = [voc.synthesize([it])[0] for it in items]
    voc.graphs = CodecGraphs(voc, capture=False)
    got = voc.synthesize(items)
    assert [a.shape for a in got] == [a.shape for a in alone] == [(samples_for_codes(n),) for n in lens]
    for a, b in zip(got[:-1], alone[:-1], strict=True):  # the last is the empty one
        assert np.abs(a - b).max() <= 1e-5
    keys = set(voc.graphs.graphs)
    assert {k[0] for k in keys} == {"decoder", "dvae"} and max(k[1] for k in keys) == CODEC_GRAPH_BATCH
    # sorted by length: the decoder's first group holds its 16 shortest items, so its frame bucket
    # is that of the 16th shortest, not of the longest
    dec = sorted(n for (u, _), n in zip(items, lens, strict=True) if u and n)
    from chattts_triton.runtime.graphs import bucket
    from chattts_triton.runtime.vocoder import CODEC_FRAMES_STEP, CODEC_GRAPH_FRAMES

    assert ("decoder", CODEC_GRAPH_BATCH, bucket(dec[CODEC_GRAPH_BATCH - 1], CODEC_FRAMES_STEP,
                                                 CODEC_GRAPH_FRAMES)) in keys


# --- the service, without Triton ------------------------------------------------------------------
def stream_context(repo, **params):
    """The ModelContext Triton would give chattts_stream."""
    from chattts_triton.triton.backend import ModelContext

    return ModelContext.from_repo(repo, STREAM, **params)


class Recorder:
    """A StreamCall that keeps the chunks; `steps_at` notes a counter (say the engine's steps) at each send."""

    def __init__(self, inputs, cancel_after: int = -1, steps_at=None):
        self.chunks, self.error, self.final = [], None, 0
        self.cancel_after = cancel_after
        self.steps_at, self.steps = steps_at, []
        self.ended = threading.Event()
        self.call = StreamCall(inputs, self.send, self.fail, self.cancelled)

    def send(self, outputs, final):
        if self.steps_at is not None:
            self.steps.append(self.steps_at())
        self.chunks.append(outputs["AUDIO"].reshape(-1))
        self.final += final
        if final:
            self.ended.set()

    def fail(self, exc):
        self.error = exc
        self.final += 1
        self.ended.set()

    def cancelled(self):
        return 0 <= self.cancel_after <= len(self.chunks)


def contract(text=TEXT, seed=5, n=None, **extra):
    inputs = {"TEXT": np.array([[text.encode()]], dtype=object), "SEED": np.array([[seed]], np.int64)}
    if n is not None:
        inputs["MIN_NEW_TOKENS"] = inputs["MAX_NEW_TOKENS"] = np.array([[n]], np.int32)
    inputs.update(extra)
    return inputs


@pytest.fixture(scope="module")
def stream_service(tiny_repo):
    from chattts_triton.triton.backend import stream_service as factory

    # exact chunks (first lookahead 0: as the later ones), with the served fade between them
    svc = factory(stream_context(tiny_repo, stream_first_chunk_frames=4, stream_chunk_frames=8,
                                 stream_first_lookahead_frames=0, stream_fade_frames=4,
                                 stream_slots=4, stream_max_pending=16))
    yield svc
    svc.close()


def test_codec_graphs_of_the_stream_windows_are_made_at_start_up(stream_service, tiny_repo, monkeypatch):
    """warm_codec (run by the constructor when the codec has graphs, i.e. on a GPU) makes the graph of
    every frame bucket a window can fall in, for 1, 2, 4, 8, 16 windows decoded together, so no
    client's chunk waits for a capture."""
    from chattts_triton.model.chunks import stream_windows
    from chattts_triton.runtime.graphs import bucket
    from chattts_triton.runtime.streaming import WARM_STREAM_FRAMES, StreamService
    from chattts_triton.runtime.vocoder import CODEC_FRAMES_STEP, CODEC_GRAPH_BATCH, CODEC_GRAPH_FRAMES, CodecGraphs
    from chattts_triton.triton.backend import stream_service as factory

    voc = stream_service.voc
    assert voc.graphs is None  # a CPU instance: no graphs, nothing to warm
    voc.graphs = CodecGraphs(voc, capture=False)
    try:
        stream_service.warm_codec()
        sizes = {w.stop - w.start for n in range(1, WARM_STREAM_FRAMES + 1)
                 for w in stream_windows(stream_service.schedule, n)}
        assert len(sizes) >= 3  # the first window, the later ones, the last
        warmed = set(voc.graphs.graphs)
        # every window of every stream, alone or with up to CODEC_GRAPH_BATCH - 1 others
        assert {("decoder", b, bucket(n, CODEC_FRAMES_STEP, CODEC_GRAPH_FRAMES))
                for b in (1, 2, 4, 8, 16) for n in sizes} <= warmed
        assert CODEC_GRAPH_BATCH == 16 and stream_service.max_streams >= 16
        assert ({k[0] for k in warmed} == {"decoder"}
                and max(k[2] for k in warmed) == bucket(max(sizes), CODEC_FRAMES_STEP, CODEC_GRAPH_FRAMES))
    finally:
        voc.graphs = None
    calls = []
    monkeypatch.setattr(StreamService, "warm_codec", lambda self: calls.append(self))
    other = factory(stream_context(tiny_repo, stream_slots=2, stream_max_pending=2))
    try:
        assert calls == [other]  # the constructor warms
    finally:
        other.close()


def offline(svc, inputs):
    """The non-streamed audio of the same request: preprocess → GPT → vocoder."""
    full = dict(inputs)
    full.update(svc.pre.prepare(inputs))
    hiddens = svc.gpt.call(full)["HIDDENS"][0]  # USE_DECODER defaults to on
    return svc.voc.synthesize([(True, torch.from_numpy(hiddens))])[0]


@pytest.mark.parametrize("n", [1, 5, 60])
def test_stream_service_chunks_equal_the_offline_audio(stream_service, n):
    rec = Recorder(contract(n=n))
    stream_service.execute([rec.call])
    assert rec.ended.wait(120) and rec.error is None and rec.final == 1
    audio = np.concatenate(rec.chunks)
    ref = offline(stream_service, contract(n=n))
    assert audio.shape == ref.shape == (samples_for_codes(n),)
    assert np.abs(audio - ref).max() <= 1e-5
    if n == 60:
        assert len(rec.chunks) > 3


def test_on_the_cpu_only_the_engine_runs_an_openmp_team_of_more_than_one_thread(stream_service, monkeypatch):
    """libgomp lets a team's idle workers spin only while the process's OpenMP threads fit the cores: the
    codec thread and each stream's preprocess thread run on one OpenMP thread, so that the engine's team is
    the stream process's only one (as in chattts_gpt); the calling thread's count is left as it was."""
    svc, seen = stream_service, {}
    prepare, synthesize = svc.pre.prepare, svc.voc.synthesize
    monkeypatch.setattr(svc.pre, "prepare", lambda inputs: seen.setdefault("preprocess", torch.get_num_threads())
                        and prepare(inputs))
    monkeypatch.setattr(svc.voc, "synthesize", lambda items: seen.setdefault("codec", torch.get_num_threads())
                        and synthesize(items))
    before = torch.get_num_threads()
    rec = Recorder(contract(n=5))
    svc.execute([rec.call])
    assert rec.ended.wait(120) and rec.error is None and rec.final == 1
    assert svc.side_threads == 1 and seen == {"preprocess": 1, "codec": 1}
    assert torch.get_num_threads() == before


def test_omp_threads_sets_the_calling_threads_count_inside_the_block_and_restores_it():
    from chattts_triton.runtime.streaming import omp_threads

    before = torch.get_num_threads()
    with omp_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with omp_threads(None):
        assert torch.get_num_threads() == before


def test_frames_that_pile_up_behind_a_slow_codec_are_sent_in_capped_windows(stream_service, monkeypatch):
    """A codec call that lags lets frames pile up; they go out as several windows of at most the
    warmed length (no codec graph captured mid-run) and the stream still equals the offline audio."""
    svc, calls = stream_service, []
    synthesize = svc.voc.synthesize

    def slow(items):
        calls.append([int(x.shape[0]) for _, x in items])
        time.sleep(0.3)  # the engine keeps generating meanwhile
        return synthesize(items)

    monkeypatch.setattr(svc.voc, "synthesize", slow)
    cap = svc.schedule["max_window"]
    rec = Recorder(contract(n=3 * cap))
    svc.execute([rec.call])
    assert rec.ended.wait(120) and rec.error is None and rec.final == 1
    monkeypatch.undo()
    assert max(max(c) for c in calls) <= cap
    assert max(len(c) for c in calls) > 1  # one stream, several windows in a call: a burst was split
    audio = np.concatenate(rec.chunks)
    ref = offline(svc, contract(n=3 * cap))
    assert audio.shape == ref.shape and np.abs(audio - ref).max() <= 1e-5


def first_chunk_steps(svc, n: int = 200):
    """Engine steps run when a lone stream's first chunk was sent, and the first chunk's frames."""
    engine = svc.gpt.engine
    rec = Recorder(contract(n=n), steps_at=lambda: engine.counters.steps)
    before = engine.counters.steps
    svc.execute([rec.call])
    assert rec.ended.wait(120) and rec.error is None and len(rec.chunks) > 2
    return rec.steps[0] - before, len(rec.chunks[0]) // SAMPLES_PER_CODE


def test_the_first_chunk_leaves_while_the_utterance_is_generated(stream_service):
    steps, frames = first_chunk_steps(stream_service)
    first, look = 4, stream_lookahead_codes(TINY_ARCH)  # the fixture's schedule: exact
    assert frames >= first and first + look - 1 <= steps < 100, (steps, frames)  # not a burst at the end


class _Req:
    """The engine request a hand-made stream holds: records cancels."""

    def __init__(self):
        self.stream_every, self.cancels = 1, 0

    def cancel(self):
        self.cancels += 1


@pytest.fixture
def hand_streams(stream_service):
    """Streams made by hand and stepped on this thread through the shared service's `_step`; whatever
    a test leaves of them is taken out of the service after it (pass or fail)."""
    from chattts_triton.runtime.streaming import _Stream

    made = []

    def make(sent=None, name=""):
        rec = Recorder(contract())
        if sent is not None:
            send = rec.call.send
            rec.call.send = lambda out, final: sent.append(name) or send(out, final)
        s = _Stream(rec.call, ChunkPlanner(**stream_service.schedule), True, time.monotonic())
        s.req = _Req()
        made.append(s)
        return s, rec

    yield make
    for s in made:
        if s in stream_service.streams:
            stream_service.streams.remove(s)


def _frames(svc, n):
    return ("tokens", (torch.zeros(n, NUM_VQ, dtype=torch.int64), torch.zeros(n, svc.voc.arch.gpt.hidden)))


@pytest.mark.parametrize("first_chunks_first", [False, True])
def test_a_new_streams_first_chunk_is_decoded_in_a_call_of_its_own_when_asked(stream_service, hand_streams, monkeypatch,
                                                                                first_chunks_first):
    """A codec step with a running stream's next window and a new stream's first window due: by default
    one call for both; with `first_chunks_first` the first window in a call of its own, sent first."""
    svc = stream_service
    monkeypatch.setattr(svc, "first_chunks_first", first_chunks_first)
    calls, sent = [], []
    monkeypatch.setattr(svc.voc, "synthesize", lambda items: calls.append([int(x.shape[0]) for _, x in items])
                        or [np.zeros(samples_for_codes(int(x.shape[0])), np.float32) for _, x in items])
    (running, _), (new, _) = hand_streams(sent, "running"), hand_streams(sent, "new")
    first = running.planner.tokens_needed()
    svc._step([(running, "start", None), (running, *_frames(svc, first))])
    assert sent == ["running"] and len(calls) == 1
    more = running.planner.tokens_needed() - first  # its second window
    svc._step([(running, *_frames(svc, more)), (new, "start", None), (new, *_frames(svc, first))])
    if first_chunks_first:
        assert sent == ["running", "new", "running"]
        assert len(calls) == 3 and calls[1] == [first] and len(calls[2]) == 1  # the first window alone, then the other
    else:
        assert sorted(sent[1:]) == ["new", "running"] and len(calls) == 2 and len(calls[1]) == 2


def test_a_failed_first_chunk_call_ends_its_stream_once_and_sends_nothing_after(stream_service, hand_streams,
                                                                                monkeypatch):
    """With `first_chunks_first`, a burst holding a new stream's first and second windows: the first
    window's own codec call fails, the stream ends with that error, and the later call of the same step
    sends it nothing more."""
    svc = stream_service
    monkeypatch.setattr(svc, "first_chunks_first", True)
    calls = []

    def synthesize(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("codec failed")
        return [np.zeros(samples_for_codes(int(x.shape[0])), np.float32) for _, x in items]

    monkeypatch.setattr(svc.voc, "synthesize", synthesize)
    s, rec = hand_streams()
    with svc.lock:  # admitted as execute would: ending it releases the place
        svc.admitted += 1
    n = svc.schedule["max_window"] + 20  # a burst longer than a window: a first window and another
    probe = ChunkPlanner(**svc.schedule)
    assert probe.next(n, False).first == 0 and probe.next(n, False) is not None
    svc._step([(s, "start", None), (s, *_frames(svc, n))])
    assert calls == [1] and rec.final == 1 and str(rec.error) == "codec failed" and not rec.chunks
    assert s.req.cancels == 1 and s.ended and s not in svc.streams and svc.admitted == 0


def test_bad_input_ends_the_stream_with_one_error(stream_service):
    rec = Recorder(contract(text="   "))
    stream_service.execute([rec.call])
    assert rec.ended.wait(30) and rec.final == 1 and "TEXT" in str(rec.error) and not rec.chunks


def test_cancel_stops_generation_and_frees_the_slot(stream_service):
    engine = stream_service.gpt.engine
    rec = Recorder(contract(n=1500), cancel_after=1)
    stream_service.execute([rec.call])
    assert rec.ended.wait(60)
    assert isinstance(rec.error, Cancelled) and rec.final == 1
    assert wait_for(lambda: engine.active == 0 and stream_service.admitted == 0, 5)
    assert engine.counters.steps < 1500  # it stopped long before its 1500 frames


def test_many_streams_with_random_cancels_leave_no_state(stream_service):
    engine = stream_service.gpt.engine
    rng = random.Random(0)
    recs = [Recorder(contract(seed=i, n=rng.choice([3, 20, 40])), cancel_after=rng.choice([-1, -1, 0, 1, 2]))
            for i in range(14)]  # more than max_slots: some wait for a slot
    stream_service.execute([r.call for r in recs])
    for r in recs:
        assert r.ended.wait(180), "a stream never ended"
        assert r.final == 1
        assert r.error is None or isinstance(r.error, Cancelled)
    assert wait_for(lambda: engine.active == 0 and engine.pending == 0 and stream_service.admitted == 0, 5)
    assert not stream_service.streams


# --- through Triton --------------------------------------------------------------------------------
def grpc_stream(server, inputs_np, cancel_after=None, timeout=120):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = []
    for name, arr in inputs_np.items():
        dt = ("BYTES" if arr.dtype == object else {np.int64: "INT64", np.int32: "INT32", np.float32: "FP32",
                                                   np.bool_: "BOOL"}[arr.dtype.type])
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    client.async_stream_infer(STREAM, inputs, request_id="s", enable_empty_final_response=True)
    chunks, error = [], None
    try:
        while True:
            result, err = q.get(timeout=timeout)
            if err is not None:
                error = err
                break
            chunks.append(result.as_numpy("AUDIO").reshape(-1) if result.as_numpy("AUDIO") is not None
                          else np.zeros(0, np.float32))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            if cancel_after is not None and len(chunks) >= cancel_after:
                break
    finally:
        client.stop_stream(cancel_requests=cancel_after is not None)
        client.close()
    return chunks, error


def metric(server, name, model=STREAM):
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") and f'model="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return None


def unary(server, inputs_np):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, arr in inputs_np.items():
        dt = "BYTES" if arr.dtype == object else {np.int64: "INT64", np.int32: "INT32"}[arr.dtype.type]
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return client.infer(ENSEMBLE, inputs).as_numpy("AUDIO").reshape(-1)


def test_grpc_stream_equals_the_ensemble_audio(served_tiny):
    chunks, error = grpc_stream(served_tiny, contract(n=70, seed=11))
    assert error is None and len(chunks) > 2
    audio = np.concatenate(chunks)
    ref = unary(served_tiny, contract(n=70, seed=11))
    assert audio.shape == ref.shape
    # the served default approximates the first chunk and its fade only (bounded in-process above); on
    # upstream-initialised decoders (layer scales 1e-6) that error is below the same bound
    assert np.abs(audio - ref).max() <= 1e-3


def test_http_sse_stream_equals_the_grpc_stream(served_tiny):
    body = json.dumps({"TEXT": TEXT, "SEED": 11, "MIN_NEW_TOKENS": 30, "MAX_NEW_TOKENS": 30}).encode()
    req = urllib.request.Request(f"http://{served_tiny.http_url}/v2/models/{STREAM}/generate_stream", data=body,
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    assert len(events) > 1 and all("AUDIO" in e for e in events)
    audio = np.concatenate([np.asarray(e["AUDIO"], np.float32).reshape(-1) for e in events])
    chunks, _ = grpc_stream(served_tiny, contract(n=30, seed=11))
    assert np.abs(audio - np.concatenate(chunks)).max() <= 1e-3


def test_the_first_response_of_a_stream_carries_spoken_text_over_grpc_and_sse(served_tiny):
    """SPOKEN_TEXT (TEXT in spoken form, as the GPT reads it) comes once per stream, with its first chunk."""
    import tritonclient.grpc as grpcclient

    text, expected = "我有3个苹果，价格是12.5元。", "我有三个苹果，价格是十二点五元。"
    client = grpcclient.InferenceServerClient(served_tiny.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = []
    for name, arr in contract(text=text, n=120, seed=3).items():
        t = grpcclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else
                                  {np.int64: "INT64", np.int32: "INT32"}[arr.dtype.type])
        t.set_data_from_numpy(arr)
        inputs.append(t)
    outputs = [grpcclient.InferRequestedOutput("AUDIO"), grpcclient.InferRequestedOutput("SPOKEN_TEXT")]
    client.async_stream_infer(STREAM, inputs, outputs=outputs, request_id="s", enable_empty_final_response=True)
    texts = []
    try:
        while True:
            result, err = q.get(timeout=120)
            assert err is None
            value = result.as_numpy("SPOKEN_TEXT")
            texts.append(None if value is None else value.reshape(-1)[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    assert len(texts) > 2 and texts[0] == expected and set(texts[1:]) == {None}

    body = json.dumps({"TEXT": text, "SEED": 3, "MIN_NEW_TOKENS": 120, "MAX_NEW_TOKENS": 120}).encode()
    req = urllib.request.Request(f"http://{served_tiny.http_url}/v2/models/{STREAM}/generate_stream", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r if line.startswith(b"data: ")]
    assert len(events) > 2 and [e.get("SPOKEN_TEXT") for e in events[1:]] == [None] * (len(events) - 1)
    first = events[0]["SPOKEN_TEXT"]
    assert (first[0] if isinstance(first, list) else first) == expected


def test_grpc_bad_input_gets_an_error_that_ends_the_stream(served_tiny):
    chunks, error = grpc_stream(served_tiny, contract(text=" "), timeout=60)
    # Triton 2.51 sends a decoupled model's error code nowhere on a gRPC stream: the message names it
    assert not chunks and error is not None and "INVALID_ARGUMENT: TEXT" in str(error)


def test_stream_counters_split_the_first_chunk_time_on_the_server(served_tiny):
    """chattts_stream's cumulative counters: one more first chunk per stream, its time at least the
    time its first tokens took, the codec's calls and chunks; read as bench.run reads them."""
    from bench.run import STREAM_COUNTERS, stream_window
    from loadtest.sweep import fetch_metrics, parse_counters

    def read():
        return parse_counters(fetch_metrics(served_tiny.metrics_url), STREAM_COUNTERS, STREAM)

    time.sleep(0.6)  # the gauges refresh every 0.25 s: let earlier streams' counts land first
    before = read()
    assert before and all(set(c) == set(STREAM_COUNTERS) for c in before.values())
    chunks, error = grpc_stream(served_tiny, contract(n=120, seed=4))
    assert error is None and len(chunks) > 2
    time.sleep(0.6)  # the gauges refresh every 0.25 s
    after = read()
    firsts = sum(c["stream_first_chunks"] for c in after.values()) - sum(c["stream_first_chunks"]
                                                                         for c in before.values())
    chunk_count = sum(c["stream_chunks"] for c in after.values()) - sum(c["stream_chunks"] for c in before.values())
    assert firsts == 1 and chunk_count == len(chunks)
    w = stream_window(before, after)
    assert 0 < w["server_first_tokens_ms"] <= w["server_first_chunk_ms"] and w["codec_call_ms"] > 0
    # one stream: each codec call decodes at least one of its windows, two or more where the codec fell behind the
    # engine (a loaded CPU: its ready chunks then go in one call)
    assert 1.0 <= w["chunks_per_codec_call"] <= chunk_count
    # its one first chunk counted in every bucket from the first bound at or above its time
    from chattts_triton.config import FIRST_CHUNK_BUCKETS_MS
    t = w["server_first_chunk_ms"]
    assert [w["server_first_chunks_within_ms"][str(ms)] for ms in FIRST_CHUNK_BUCKETS_MS] == [
        float(t <= ms) for ms in FIRST_CHUNK_BUCKETS_MS]
    assert w["server_first_chunk_p99_within_ms"] == min((ms for ms in FIRST_CHUNK_BUCKETS_MS if t <= ms), default=None)


def test_bench_stream_spreads_its_clients_over_processes_and_reads_the_server_between_warm_up_and_window(served_tiny):
    """bench.run's stream load from two client processes: none failed, and the server's counters,
    read after both processes' warm-ups and once the window's streams have all ended, count exactly
    the window's streams (a warm-up stream in the window, or a refresh of the gauges not waited
    for, would not). Each stream forces its own length (--tokens 8-16), and its audio is that length's."""
    from bench.run import bench_stream
    from loadtest.lengths import Lengths

    row = bench_stream(served_tiny.grpc_url, Lengths(8, 16), 3, 2.0, served_tiny.metrics_url, procs=2)
    assert row["client_processes"] == 2 and row["errors"] == 0 and row["streams"] >= 3, row
    assert row["frames_mismatched"] == 0 and row["audio_s_per_s"] > 0
    assert row["first_chunk_p50_ms"] <= row["stream_p50_ms"]
    assert row["server_first_chunks"] == row["streams"]


def test_grpc_cancel_frees_the_stream_slot_in_triton_metrics(served_tiny):
    chunks, error = grpc_stream(served_tiny, contract(n=2000, seed=3), cancel_after=1)
    assert error is None and len(chunks) == 1
    assert wait_for(lambda: metric(served_tiny, "chattts_engine_active") == 0
                    and metric(served_tiny, "chattts_streams") == 0, 10)
    # and the model still serves
    chunks, error = grpc_stream(served_tiny, contract(n=5))
    assert error is None and np.concatenate(chunks).shape == (samples_for_codes(5),)


def test_demo_compares_the_stream_exactly_after_the_first_chunk_and_fade():
    from client.demo import compare_stream

    rng = np.random.default_rng(0)
    audio = rng.standard_normal(5000).astype(np.float32)
    streamed = audio.copy()
    streamed[:1000] += 0.01 * rng.standard_normal(1000).astype(np.float32)  # an approximate first chunk
    same, msg = compare_stream(streamed, audio, 1000)
    assert same and "SNR 40 dB" in msg
    assert compare_stream(audio.copy(), audio, 0)[0]
    assert "exact" in compare_stream(audio.copy(), audio, 1000)[1]
    assert not compare_stream(streamed, audio, 500)[0]  # approximate samples past the exact start
    assert not compare_stream(streamed[:-1], audio, 1000)[0]
