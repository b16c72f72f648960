"""How far a stream's first chunk and its fade are from the whole-utterance audio, for the weights of
an exported repository: `python -m bench.probes.stream_error --repo build/repo`.

After the first chunk's fade a stream equals the whole-utterance audio (tests/test_streaming.py);
the first chunk and the fade depend on the weights, because the first window sees only
`first_lookahead` frames to its right. This runs the repository's preprocess, GPT and vocoder
in-process on the CPU, generates utterances, decodes each whole and as the stream's first two windows
do, and prints the error of the first chunk and of the fade for each first lookahead (max abs error,
and signal-to-error ratio in dB: the error's RMS against the audio's over the same samples).

Synthetic weights keep upstream's initial decoder layer scales (1e-6), which hide most of the
receptive field; `--layer-scale 0.5` raises them (in memory) to show what larger, trained scales do.
Real weights need no flag.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import numpy as np
import torch

from chattts_triton.config import SAMPLES_PER_CODE, STREAM
from chattts_triton.model.chunks import ChunkPlanner, chunk_samples, stream_schedule
from chattts_triton.triton.backend import ModelContext, stream_service
from chattts_triton.triton.deployment import Deployment
from client.audio import snr_db

TEXTS = ["四川美食确实以辣闻名，但也有不辣的选择。", "Hello, this is a streaming test of the first chunk."]


def first_two_windows(planner: ChunkPlanner, frames: int):
    """The first two windows as frames arrive one by one (the earliest each can be sent)."""
    wins = []
    for n in range(1, frames + 1):
        w = planner.next(n, False)
        if w is not None:
            wins.append(w)
            if len(wins) == 2:
                return wins
    raise ValueError(f"{frames} frames are too few for two chunks: use more --tokens")


def raise_layer_scales(voc, scale: float, seed: int = 1) -> int:
    """Set every ConvNeXt layer scale of the decoders and Vocos to scale × U(0.5, 1.5); returns how many."""
    g = torch.Generator().manual_seed(seed)
    count = 0
    for net in (voc.decoder, voc.dvae, voc.vocos):
        module = getattr(net, "module", None)
        if module is None:
            raise SystemExit("--layer-scale needs the TorchScript artifacts (artifact_format torchscript)")
        for m in module.modules():
            if getattr(m, "original_name", type(m).__name__) == "ConvNeXtBlock":
                with torch.no_grad():
                    m.weight.copy_(scale * (0.5 + torch.rand(m.weight.shape, generator=g)))
                count += 1
    return count


def measure(voc, arch, hiddens: list[np.ndarray], first_chunk: int, chunk: int, first_lookahead: int,
            fade: int) -> dict:
    schedule = stream_schedule(arch, first_chunk, chunk, 0, first_lookahead, fade)
    first_err, fade_err, first_ref, fade_ref = [], [], [], []
    for hid in hiddens:
        x = torch.from_numpy(hid)
        whole = voc.synthesize([(True, x)])[0]
        a, b = first_two_windows(ChunkPlanner(**schedule), x.shape[0])
        audio_a, audio_b = voc.synthesize([(True, x[a.start:a.stop]), (True, x[b.start:b.stop])])
        sent_a, held = chunk_samples(a, audio_a, None)
        sent_b, _ = chunk_samples(b, audio_b, held)
        g0 = a.start * SAMPLES_PER_CODE + a.first
        g1 = g0 + sent_a.shape[0]
        k = 0 if held is None else held.shape[0]
        first_err.append(sent_a - whole[g0:g1])
        first_ref.append(whole[g0:g1])
        fade_err.append(sent_b[:k] - whole[g1:g1 + k])
        fade_ref.append(whole[g1:g1 + k])
    fe, fr = np.concatenate(first_err), np.concatenate(first_ref)
    de, dr = np.concatenate(fade_err), np.concatenate(fade_ref)
    return {"first_lookahead": schedule["first_lookahead"], "fade": a.hold // SAMPLES_PER_CODE,  # exact: none
            "first_chunk_frames": first_chunk,
            "first_chunk_after_frames": first_chunk + schedule["first_lookahead"],
            "first_chunk_max_err": float(np.abs(fe).max()), "first_chunk_snr_db": snr_db(fr, fe),
            "fade_max_err": float(np.abs(de).max()) if de.size else 0.0,
            "fade_snr_db": snr_db(dr, de), "audio_rms": float(np.sqrt(np.mean(fr ** 2)))}


def to_markdown(res: dict) -> str:
    out = [f"# first-chunk error, {res['repo']} ({res['date']})", "",
           f"{res['utterances']} utterances of {res['tokens']} frames; layer scales: {res['layer_scale']}.", "",
           "| first lookahead | fade | first chunk after (frames) | first chunk max err | first chunk SNR dB | "
           "fade max err | fade SNR dB |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['first_lookahead']} | {r['fade']} | {r['first_chunk_after_frames']} | "
                   f"{r['first_chunk_max_err']:.2e} | "
                   f"{r['first_chunk_snr_db']:.1f} | {r['fade_max_err']:.2e} | {r['fade_snr_db']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    d = Deployment()
    ap = argparse.ArgumentParser(prog="python -m bench.probes.stream_error", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="an exported repository (python -m export)")
    ap.add_argument("--first-lookahead", default="2,4,8,16,0", help="first lookaheads to compare (0: exact)")
    ap.add_argument("--fade", type=int, default=d.stream_fade_frames, help="frames faded (at most each lookahead)")
    ap.add_argument("--first-chunk", type=int, default=d.stream_first_chunk_frames)
    ap.add_argument("--chunk", type=int, default=d.stream_chunk_frames)
    ap.add_argument("--tokens", type=int, default=150, help="frames per utterance (forced)")
    ap.add_argument("--seeds", type=int, default=2, help="utterances per text")
    ap.add_argument("--layer-scale", type=float, default=None,
                    help="synthetic weights only: raise the ConvNeXt layer scales")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    a = ap.parse_args(argv)
    try:
        lookaheads = [int(v) for v in a.first_lookahead.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--first-lookahead takes comma-separated frame counts, got {a.first_lookahead!r}")
    if not (a.repo / STREAM / "config.pbtxt").is_file():
        ap.error(f"{a.repo} is not an exported repository (no {STREAM}/config.pbtxt): run python -m export first")

    svc = stream_service(ModelContext.from_repo(a.repo, STREAM))
    try:
        arch = svc.pre.arch
        if a.layer_scale is not None:
            print(f"raised {raise_layer_scales(svc.voc, a.layer_scale)} layer scales to ≈ {a.layer_scale}",
                  file=sys.stderr)
        hiddens = []
        for text in TEXTS:
            for seed in range(1, a.seeds + 1):
                inputs = {"TEXT": np.array([[text.encode()]], dtype=object), "SEED": np.array([[seed]], np.int64),
                          "MIN_NEW_TOKENS": np.array([[a.tokens]], np.int32),
                          "MAX_NEW_TOKENS": np.array([[a.tokens]], np.int32)}
                full = dict(inputs)
                full.update(svc.pre.prepare(inputs))
                hiddens.append(svc.gpt.call(full)["HIDDENS"][0])
                print(f"generated utterance {len(hiddens)}", file=sys.stderr)
        rows = []
        for la in lookaheads:
            fade = min(a.fade, la - 1) if la else a.fade  # a fade must be shorter than the lookahead
            try:
                rows.append(measure(svc.voc, arch, hiddens, a.first_chunk, a.chunk, la, fade))
            except ValueError as e:  # a refused schedule, or too few frames for two chunks
                ap.error(str(e))
            print(to_markdown({"repo": str(a.repo), "date": "", "utterances": len(hiddens), "tokens": a.tokens,
                               "layer_scale": a.layer_scale, "rows": rows[-1:]}).splitlines()[-1], file=sys.stderr)
    finally:
        svc.close()
    res = {"date": dt.date.today().isoformat(), "repo": str(a.repo), "utterances": len(hiddens), "tokens": a.tokens,
           "layer_scale": a.layer_scale if a.layer_scale is not None else "as exported", "command": " ".join(sys.argv),
           "rows": rows}
    md = to_markdown(res)
    print(md)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{a.out}.json").write_text(json.dumps(res, indent=2))
        Path(f"{a.out}.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
