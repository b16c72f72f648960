"""`make demo`: start Triton on an exported repository, synthesise one sentence over gRPC, stream it, then the
same through the OpenAI-compatible speech gateway with OpenAI's own client (build/demo.mp3), stop.

    python -m client.demo --repo build/repo --out build/demo.wav [--text "..."] [--synthetic] [--no-gateway]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_TEXT = "四川美食确实以辣闻名，但也有不辣的选择。"
WARNING = """
  ****************************************************************************************
  *  These are RANDOM synthetic weights of the ChatTTS architecture: the WAV is NOISE.   *
  *  For speech, export real weights:  make demo ASSETS=/path/to/ChatTTS/asset           *
  ****************************************************************************************
"""


def compare_stream(streamed, audio, exact_from: int):
    """(same, message): the stream against the synthesised audio. Samples from `exact_from` on must
    match (≤ 1e-3); before it the early first chunk and its fade approximate them, reported as SNR."""
    import numpy as np

    from client.audio import snr_db

    if streamed.shape != audio.shape:
        return False, f"DIFFERENT from the synthesised audio: {streamed.size} samples, not {audio.size}"
    tail = float(np.abs(streamed[exact_from:] - audio[exact_from:]).max(initial=0.0))
    if tail > 1e-3:
        return False, f"DIFFERENT from the synthesised audio after sample {exact_from}: max abs difference {tail:.2e}"
    ratio = snr_db(audio[:exact_from], streamed[:exact_from] - audio[:exact_from])
    snr = "exact" if ratio > 180 else f"SNR {ratio:.0f} dB"
    return True, (f"equal to the synthesised audio (max abs difference {tail:.1e}) after its first "
                  f"{exact_from} samples (early first chunk and fade: {snr})")


def speech_through_gateway(grpc_url: str, a, options: dict, say) -> bool:
    """`python -m gateway` in front of the server, called as OpenAI's speech API by the `openai` package."""
    import subprocess
    import urllib.request

    import av
    import openai

    from chattts_triton.launcher.tritonserver import free_port

    port = free_port()
    log = a.out.with_suffix(".gateway.log")
    with open(log, "wb") as out:
        gateway = subprocess.Popen([sys.executable, "-m", "gateway", "--grpc-url", grpc_url, "--port", str(port),
                                    "--repo", str(a.repo)], stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                if gateway.poll() is not None or time.monotonic() > deadline:
                    say(f"[demo] the speech gateway did not start (log: {log})")
                    return False
                time.sleep(0.3)
        say(f"[demo] speech gateway on {url} (playground: {url}/, log: {log})")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        extra = {k: v for k, v in options.items() if k != "seed"}  # the synthetic cap, if any
        t0 = time.perf_counter()
        speech = client.audio.speech.create(model="chattts", voice="alloy", input=a.text, response_format="mp3",
                                            extra_body={"seed": a.seed, **extra})
        took = time.perf_counter() - t0
        mp3 = a.out.with_suffix(".mp3")
        mp3.write_bytes(speech.content)
        with av.open(str(mp3)) as f:  # FFmpeg reads it back: playable audio
            seconds = sum(frame.samples for frame in f.decode(audio=0)) / f.streams.audio[0].rate
        say(f"[demo] openai.OpenAI(base_url='{url}/v1').audio.speech.create(model='chattts', voice='alloy', "
            f"response_format='mp3') → {mp3}: {seconds:.2f} s of MP3 in {took:.2f} s")
        return seconds > 0
    finally:
        gateway.terminate()
        gateway.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("build/demo.wav"))
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--synthetic", action="store_true",
                    help="the repository holds random weights: warn, cap the length")
    ap.add_argument("--no-gateway", dest="gateway", action="store_false", help="skip the speech gateway's part")
    a = ap.parse_args(argv)

    import numpy as np

    from chattts_triton.config import SAMPLE_RATE, SAMPLES_PER_CODE, Arch
    from chattts_triton.launcher.tritonserver import TritonServer
    from chattts_triton.triton.repo_config import Deployment, read_manifest
    from client.audio import save_wav
    from client.client import ChatTTSClient, split_sentences

    def say(m):
        print(m, file=sys.stderr, flush=True)
    if a.synthetic:
        say(WARNING)
    log = a.out.with_suffix(".tritonserver.log")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    say(f"[demo] starting tritonserver on {a.repo} (log: {log})")
    t0 = time.perf_counter()
    with TritonServer(a.repo, log_file=log, startup_timeout_s=600) as server:
        say(f"[demo] ready in {time.perf_counter() - t0:.0f} s: grpc {server.grpc_url}, http {server.http_url}")
        options = {"seed": a.seed}
        if a.synthetic:  # random weights rarely emit EOS early: keep the noise short
            options.update(max_new_tokens=150)
        t1 = time.perf_counter()
        with ChatTTSClient(server.grpc_url, protocol="grpc", timeout_s=600) as client:
            audio = client.synthesize(a.text, **options)
            took = time.perf_counter() - t1
            save_wav(a.out, audio)
            seconds = audio.size / SAMPLE_RATE
            say(f"[demo] {a.text!r} → {a.out}: {seconds:.2f} s of audio in {took:.2f} s (RTF "
                f"{took / max(seconds, 1e-9):.2f})")
            t2 = time.perf_counter()
            chunks, first = [], None
            for chunk in client.stream(a.text, **options):  # chattts_stream: the same audio in chunks
                first = first if first is not None else time.perf_counter() - t2
                chunks.append(chunk)
            streamed = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            say(f"[demo] streamed: {len(chunks)} chunks, first after {first or 0:.2f} s, all after "
                f"{time.perf_counter() - t2:.2f} s")
            if len(split_sentences(a.text)) == 1:  # several: the voice of sentence 1 is re-used differently
                man = read_manifest(a.repo)
                plan = Deployment.from_manifest(man).stream_schedule(Arch.from_json(man["arch"]))
                early = plan["first_lookahead"] < plan["exact"] and chunks  # an approximate first window
                exact_from = len(chunks[0]) + plan["fade"] * SAMPLES_PER_CODE if early else 0
                same, message = compare_stream(streamed, audio, exact_from)
                say(f"[demo] the stream is {message}")
                if not same:
                    return 1
        if a.gateway and not speech_through_gateway(server.grpc_url, a, options, say):
            return 1
    if a.synthetic:
        say(WARNING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
