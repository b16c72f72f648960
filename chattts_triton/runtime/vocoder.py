"""`chattts_vocoder`: codes or hidden states → 24 kHz audio through the exported decoder, DVAE and Vocos,
batched across requests; on a GPU replayed from CUDA graphs (`CodecGraphs`). `chattts_stream` runs one for
its chunks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..config import MEL_FRAMES_PER_CODE, NUM_VQ, USE_DECODER_DEFAULT, Arch, samples_for_codes
from ..model.codec import codec_eager_from_script
from ..model.text import InputError
from .artifacts import Artifact
from .graphs import GraphCache, bucket, to_host_async
from .inputs import Call, get_bool

log = logging.getLogger(__name__)

CODEC_BATCH_STEP = 8  # codec graph batch buckets: powers of two up to this, then its multiples
CODEC_GRAPH_BATCH = 16  # a codec call of more items replays several graphs of at most this many
CODEC_FRAMES_STEP = 32  # code-frame buckets, likewise
CODEC_GRAPH_FRAMES = 4096  # padded batches over this many code frames run eagerly
CODEC_GRAPH_ITEM_FRAMES = 512  # ... and groups of items longer than this (bounds the buckets a server meets)


class VocoderService:
    """Codes or hidden states → 24 kHz audio, batched across requests, each trimmed to its length.
    graphs (CUDA, TorchScript artifacts): groups that fit run from `CodecGraphs` (on for the stream
    model's codec, whose windows come in a few sizes; for chattts_vocoder by default, `Deployment.vocoder_graphs`).
    compile_codec (with graphs): what the graphs replay is the artifacts' networks through torch.compile
    (`Deployment.codec_compile`), compiled at start-up; eager calls keep the artifacts."""

    def __init__(self, version_dir: Path, arch: Arch, device: torch.device, artifact_format: str, graphs: bool = False,
                 compile_codec: bool = False):
        self.arch = arch
        self.device = device
        d = Path(version_dir)
        self.decoder = Artifact(d / "decoder", artifact_format, device)
        self.dvae = Artifact(d / "dvae_decode", artifact_format, device)
        self.vocos = Artifact(d / "vocos", artifact_format, device)
        self.graph_nets: tuple = (self.decoder, self.dvae, self.vocos)  # what `decode` runs in the graphs
        self.graphs: CodecGraphs | None = None
        for _ in range(2):  # warm-up, as for the GPT
            self.synthesize_eager([(True, torch.zeros(3, arch.gpt.hidden)),
                                   (False, torch.zeros(2, NUM_VQ, dtype=torch.int64))])
        if graphs and device.type == "cuda" and artifact_format == "torchscript":
            if compile_codec:
                self.compile_graphs()
            else:
                self.graphs = CodecGraphs(self)

    def compile_graphs(self, backend: str | Callable = "inductor", capture: bool = True) -> None:
        """The graphs replay `compiled_nets`, compiled now (`warm_compiled`); a failure names the setting, since
        inductor's own error does not. backend, capture: the CPU tests' (a recording backend, no CUDA)."""
        self.graph_nets = compiled_nets(self, backend)
        self.graphs = CodecGraphs(self, capture=capture)
        try:
            self.warm_compiled()
        except Exception as e:
            raise RuntimeError(f"codec_compile (--codec-compile): torch.compile of the codec failed at start-up "
                               f"({type(e).__name__}: {e}); serve without --codec-compile") from e

    def warm_compiled(self) -> None:
        """Compile now, not in some client's call: both paths with a batch and a frame bucket of 1 and of more, since
        torch.compile specialises a size of 1 (one graph each) and makes a size dynamic once it has changed; later
        buckets then replay without recompiling."""
        for n, frames in ((1, 1), (1, 3), (2, 1), (2, 40)):
            self.graphs.synthesize([(True, torch.zeros(frames, self.arch.gpt.hidden))] * n
                                   + [(False, torch.zeros(frames, NUM_VQ, dtype=torch.int64))] * n)

    def execute(self, calls: Sequence[Call]) -> None:
        items = []
        for c in calls:
            try:
                items.append((c, self.parse(c.inputs)))
            except Exception as e:  # noqa: BLE001  every failure becomes this request's error
                c.reply(e)
        if not items:
            return
        try:
            audios = self.synthesize([x for _, x in items])
        except Exception as e:
            log.exception("vocoder batch failed")
            for c, _ in items:
                c.reply(e)
            return
        for (c, _), a in zip(items, audios, strict=True):
            c.reply({"AUDIO": a.reshape(1, -1)})

    def parse(self, inputs):
        use_decoder = get_bool(inputs, "USE_DECODER", USE_DECODER_DEFAULT)
        codes = np.asarray(inputs["CODES"], dtype=np.int64).reshape(-1, NUM_VQ)
        if use_decoder:
            hid = np.asarray(inputs["HIDDENS"], dtype=np.float32).reshape(-1, self.arch.gpt.hidden)
            if hid.shape[0] != codes.shape[0]:
                raise InputError("HIDDENS must have one row per code step (USE_DECODER needs the GPT hidden states)")
            return True, torch.from_numpy(hid.copy())
        if codes.size and (codes.min() < 0 or codes.max() >= self.arch.num_audio_tokens):
            raise InputError("CODES out of range")
        return False, torch.from_numpy(codes.copy())

    def decode(self, use_decoder: bool, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One path's padded batch (hidden states [B, T, H] or codes [B, T, 4], lengths [B]) → audio
        [B, samples of T frames], each item's zero past its own length, by `graph_nets` (what the graphs replay)."""
        decoder, dvae, vocos = self.graph_nets
        mel = (decoder if use_decoder else dvae)(x, lengths)
        return vocos(mel, lengths * MEL_FRAMES_PER_CODE).float()

    def synthesize(self, items: list[tuple]) -> list[np.ndarray]:
        """(use_decoder, hidden states [T, H] or codes [T, 4]) per item → its audio."""
        if self.graphs is not None:
            return self.graphs.synthesize(items)
        return self.synthesize_eager(items)

    def synthesize_eager(self, items: list[tuple]) -> list[np.ndarray]:
        """`synthesize` as one eager batch per path (any sizes, both paths, empty items)."""
        mels: list[torch.Tensor | None] = [None] * len(items)
        for use_decoder, net in ((True, self.decoder), (False, self.dvae)):
            idx = [i for i, (u, x) in enumerate(items) if u == use_decoder and x.shape[0] > 0]
            if not idx:
                continue
            lens = torch.tensor([items[i][1].shape[0] for i in idx], dtype=torch.int64)
            batch = torch.nn.utils.rnn.pad_sequence([items[i][1] for i in idx], batch_first=True)
            mel = net(batch, lens)
            for j, i in enumerate(idx):
                mels[i] = mel[j, :, : 2 * int(lens[j])]
        out: list[np.ndarray] = [np.zeros(0, np.float32) for _ in items]
        idx = [i for i, m in enumerate(mels) if m is not None]
        if idx:
            mel_lens = torch.tensor([mels[i].shape[1] for i in idx], dtype=torch.int64)
            padded = torch.nn.utils.rnn.pad_sequence([mels[i].T for i in idx], batch_first=True).transpose(1, 2)
            audio = self.vocos(padded.contiguous(), mel_lens).float().cpu()
            for j, i in enumerate(idx):
                n = samples_for_codes(items[i][1].shape[0])
                out[i] = audio[j, :n].numpy()
        return out

    def close(self) -> None:
        pass


def compiled_nets(voc: VocoderService, backend: str | Callable = "inductor") -> tuple:
    """The decoder, DVAE and Vocos artifacts' networks as plain modules through torch.compile (dynamic shapes: one
    compile serves every graph bucket): the elementwise chains, norms and depthwise convolutions fused
    (`model.codec.depthwise_as_sum`). backend: torch.compile's (the CPU tests' records what dynamo traces)."""
    nets = []
    for art, name in ((voc.decoder, "decoder"), (voc.dvae, "dvae_decode"), (voc.vocos, "vocos")):
        module = codec_eager_from_script(art.module, name, voc.arch)
        fn = torch.compile(module, dynamic=True, backend=backend)

        def run(*args: torch.Tensor, fn=fn) -> torch.Tensor:
            with torch.inference_mode():
                return fn(*[a.to(voc.device) for a in args])
        nets.append(run)
    return tuple(nets)


class CodecGraphs(GraphCache):
    """`VocoderService.synthesize` of one padded batch (every item through the decoder, or every one
    through the DVAE, then Vocos) replayed from a CUDA graph per (path, batch bucket, frame bucket):
    a codec call is one launch instead of hundreds. Beside a generating engine (the stream model) an
    eager call's launches queue behind the engine's steps and take tens of times longer than its graph
    (docs/performance.md). Bucket padding: zero frames, and rows of one code frame (their samples are
    dropped with the rest of the padding)."""

    def __init__(self, voc: VocoderService, capture: bool = True):
        super().__init__(voc.device, capture)
        self.voc = voc
        self.inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def buckets(self, n: int, frames: int) -> tuple[int, int]:
        return bucket(n, CODEC_BATCH_STEP, CODEC_GRAPH_FRAMES), bucket(frames, CODEC_FRAMES_STEP, CODEC_GRAPH_FRAMES)

    def synthesize(self, items: list[tuple]) -> list[np.ndarray]:
        """The items' audio: per path, the items by length in graphs of at most CODEC_GRAPH_BATCH
        (similar lengths share a frame bucket; a call for the stream model's 64 streams is 4 replays
        of buckets captured at start-up); a group over CODEC_GRAPH_FRAMES padded frames or of items
        over CODEC_GRAPH_ITEM_FRAMES runs eagerly, an empty item gets empty audio. Every group's inputs, replay and
        audio copy are enqueued before the host waits, once, for the last copy: the host builds the next group's
        batch while the GPU runs the one before (a group's copies and replay follow the group before it on the
        stream, so a graph's static buffers are never overwritten before they are read)."""
        out: list[np.ndarray | None] = [None] * len(items)
        eager: list[int] = []
        launched: list[tuple[list[int], torch.Tensor, list[int]]] = []
        done = None
        for use_decoder in (True, False):
            idx = sorted((i for i, (u, x) in enumerate(items) if u == use_decoder and x.shape[0] > 0),
                         key=lambda i: items[i][1].shape[0])
            for lo in range(0, len(idx), CODEC_GRAPH_BATCH):
                group = idx[lo : lo + CODEC_GRAPH_BATCH]
                got = self._launch(use_decoder, [items[i][1] for i in group])
                if got is None:
                    eager += group
                    continue
                audio, done = got
                launched.append((group, audio, [int(items[i][1].shape[0]) for i in group]))
        if done is not None:
            done.synchronize()
        for group, audio, lens in launched:
            for j, (i, n) in enumerate(zip(group, lens, strict=True)):
                out[i] = audio[j, : samples_for_codes(n)].numpy()
        if eager:  # what did not fit a graph: one eager batch per path
            for i, a in zip(eager, self.voc.synthesize_eager([items[i] for i in eager]), strict=True):
                out[i] = a
        return [np.zeros(0, np.float32) if a is None else a for a in out]

    def _launch(self, use_decoder: bool, xs: list[torch.Tensor]) -> tuple[torch.Tensor, object] | None:
        """One group's padded batch from its graph, enqueued: its audio [bucket, samples] on the host once the
        returned event (None on the CPU) is done; None where the group is over the graphs' limits."""
        lens = [int(x.shape[0]) for x in xs]
        bb, tb = self.buckets(len(xs), max(lens))
        if bb * tb > CODEC_GRAPH_FRAMES or tb > CODEC_GRAPH_ITEM_FRAMES:
            return None
        key = ("decoder" if use_decoder else "dvae", bb, tb)
        pinned = self.device.type == "cuda"  # built in pinned memory: the copy to the device is asynchronous
        batch = torch.zeros((bb, tb) + tuple(xs[0].shape[1:]), dtype=xs[0].dtype, pin_memory=pinned)
        for i, x in enumerate(xs):
            batch[i, : x.shape[0]] = x
        lengths = torch.ones(bb, dtype=torch.int64, pin_memory=pinned)
        lengths[: len(xs)] = torch.tensor(lens)
        static = self.inputs.get(key)
        if static is None:
            static = self.inputs[key] = (torch.zeros_like(batch, device=self.device),
                                         torch.ones_like(lengths, device=self.device))
        for buf, t in zip(static, (batch, lengths), strict=True):
            buf.copy_(t, non_blocking=True)

        def decode() -> torch.Tensor:
            return self.voc.decode(use_decoder, *static)

        run = self._graph(key, lambda: [decode() for _ in range(3)], decode)
        return to_host_async(run() if run is not None else decode())
