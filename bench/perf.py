"""Triton's own load tool, `perf_analyzer`, against the `chattts` ensemble: the cross-check of bench.run's figures.

    python -m bench.perf --url 127.0.0.1:8001 [--concurrency 1,8,64,256] [--frames 150 | --frames 50-400] \
        [--out build/perf]
    make perf GRPC_PORT=8001 PERF_CONCURRENCY=1,64 FRAMES=50-400

Each level is one perf_analyzer run over gRPC (`--concurrency-range N`, time windows, its own stability
check), every request forced to `--frames` code frames (MIN_NEW_TOKENS = MAX_NEW_TOKENS) from an input-data
file written here. `--frames A-B`: the file holds one entry per length, up to 16 spread evenly over [A, B],
and perf_analyzer sends its entries in turn (round-robin), so the load is that mix. Prints a table
(requests/s, audio seconds/s, p50/p90/p99 latency) and writes <out>/perf.json, .md and the input file.

perf_analyzer is a C++ binary. PyPI's `perf-analyzer` is a placeholder and tritonclient stopped shipping it
after 2.41, so `prepare` takes the binary from the `tritonclient==2.41.0` manylinux wheel, libb64 from
Debian's `libb64-0d` and libcudart.so.12 from `nvidia-cuda-runtime-cu12` (the binary links both), into
build/perf-analyzer/ (`$PERF_ANALYZER` names another binary; the GPU host gets these files in the bundle).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from chattts_triton.config import SAMPLE_RATE, samples_for_codes
from loadtest.lengths import Lengths, lengths_arg

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "build" / "perf-analyzer"
TRITONCLIENT_WITH_PERF = "tritonclient==2.41.0"
WHEEL_BINARY = "tritonclient-2.41.0.data/data/bin/perf_analyzer"
CUDART_WHEEL = "nvidia-cuda-runtime-cu12==12.8.90"
LIBS = ("libb64.so.0d", "libcudart.so.12")
ENTRIES = 16  # lengths in the input file of a --frames A-B run
TEXT = "四川美食确实以辣闻名，但也有不辣的选择。"  # bench.run's sentence


class PerfError(RuntimeError):
    pass


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise PerfError(f"{' '.join(cmd)} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-800:]}")
    return r


def _pip_download(spec: str, dest: Path) -> Path:
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), spec])
    wheels = sorted(dest.glob(f"{spec.split('==')[0].replace('-', '_')}-*.whl"))
    if not wheels:
        raise PerfError(f"pip downloaded no wheel for {spec} into {dest}")
    return wheels[-1]


def _libb64(dest: Path, tmp: Path) -> None:
    for system in (Path("/usr/lib/x86_64-linux-gnu/libb64.so.0d"), Path("/usr/lib/libb64.so.0d")):
        if system.is_file():
            shutil.copy2(system, dest / "libb64.so.0d")
            return
    # not installed: Debian's package, unpacked here (apt-get download needs no root)
    _run(["apt-get", "download", "libb64-0d"], cwd=tmp)
    deb = next(tmp.glob("libb64-0d_*.deb"))
    _run(["dpkg-deb", "-x", str(deb), str(tmp / "root")])
    found = next((tmp / "root").rglob("libb64.so.0d*"))
    shutil.copy2(found.resolve(), dest / "libb64.so.0d")


def _cudart(dest: Path, tmp: Path) -> None:
    try:  # torch's CUDA wheels bring it
        import nvidia.cuda_runtime as rt

        lib = Path(list(rt.__path__)[0]) / "lib" / "libcudart.so.12"
        if lib.is_file():
            shutil.copy2(lib, dest / "libcudart.so.12")
            return
    except ImportError:
        pass
    wheel = _pip_download(CUDART_WHEEL, tmp)
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith("lib/libcudart.so.12"))
        (dest / "libcudart.so.12").write_bytes(z.read(name))


def prepare(dest: Path = DEFAULT_DIR) -> Path:
    """The perf_analyzer binary, with the libraries it links beside it (fetched once); `$PERF_ANALYZER` wins."""
    override = os.environ.get("PERF_ANALYZER")
    if override:
        if not os.access(override, os.X_OK):
            raise PerfError(f"PERF_ANALYZER={override} is not an executable file")
        return Path(override)
    binary = dest / "perf_analyzer"
    if binary.is_file() and all((dest / lib).is_file() for lib in LIBS):
        return binary
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        wheel = _pip_download(TRITONCLIENT_WITH_PERF, tmp)
        with zipfile.ZipFile(wheel) as z:
            (dest / "perf_analyzer.tmp").write_bytes(z.read(WHEEL_BINARY))
        _libb64(dest, tmp)
        _cudart(dest, tmp)
    (dest / "perf_analyzer.tmp").chmod(0o755)
    os.replace(dest / "perf_analyzer.tmp", binary)
    return binary


def environment(binary: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(binary.parent), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def entry_frames(frames) -> list[int]:
    """The lengths of the input file's entries: N, or up to ENTRIES spread evenly over A-B."""
    return Lengths.of(frames).spread(ENTRIES)


def mean_audio_s(frames) -> float:
    """Mean audio of the entries, which perf_analyzer sends in turn."""
    lengths = entry_frames(frames)
    return sum(samples_for_codes(f) for f in lengths) / len(lengths) / SAMPLE_RATE


def write_input_data(path: Path, frames, text: str = TEXT, seed: int = 1) -> Path:
    """perf_analyzer's --input-data for `chattts`: one request per entry_frames length, each forcing its own
    (MIN = MAX), every input shaped [1] (it adds the batch dim)."""
    data = {"data": [{"TEXT": {"content": [text], "shape": [1]}, "SEED": {"content": [seed], "shape": [1]},
                      "MAX_NEW_TOKENS": {"content": [f], "shape": [1]},
                      "MIN_NEW_TOKENS": {"content": [f], "shape": [1]}} for f in entry_frames(frames)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


def command(binary: Path, url: str, concurrency: int, input_data: Path, csv_path: Path, window_ms: int,
            stability: int = 25, protocol: str = "grpc") -> list[str]:
    return [str(binary), "-m", "chattts", "-i", protocol, "-u", url, "-b", "1", "--input-data", str(input_data),
            "--concurrency-range", str(concurrency), "--measurement-mode", "time_windows",
            "--measurement-interval", str(window_ms), "--stability-percentage", str(stability), "--max-trials", "6",
            "--percentile", "99", "-f", str(csv_path)]


def parse_csv(path: Path) -> dict:
    """perf_analyzer's -f CSV row: requests/s and client latency percentiles (µs → ms)."""
    with open(path, newline="") as f:
        row = next(csv.DictReader(f))
    def ms(k):
        return float(row[k]) / 1000 if row.get(k) not in (None, "") else None
    return {"concurrency": int(row["Concurrency"]), "throughput_utt_s": float(row["Inferences/Second"]),
            "latency_p50_ms": ms("p50 latency"), "latency_p90_ms": ms("p90 latency"),
            "latency_p99_ms": ms("p99 latency"), "latency_avg_ms": ms("Avg latency")}


def run(url: str, levels: list[int], frames, out: Path, window_ms: int = 5000, binary: Path | None = None,
        log=print, stability: int = 25, protocol: str = "grpc", keep_going: bool = False) -> list[dict]:
    """One perf_analyzer run per level; stability: the spread (%) its last three windows must fall within.
    frames: N, or a Lengths / "A-B" (a mix: write_input_data). A level that fails raises PerfError, or with
    `keep_going` is the row {"concurrency", "error"} and the next level runs (a benchmark's later phases are kept)."""
    binary = binary or prepare()
    data = write_input_data(out / "perf-input.json", frames)
    rows = []
    for c in levels:
        csv_path = out / f"perf-c{c}.csv"
        cmd = command(binary, url, c, data, csv_path, window_ms, stability, protocol)
        r = subprocess.run(cmd, capture_output=True, text=True, env=environment(binary),
                           timeout=60 + 8 * window_ms / 1000)
        if r.returncode != 0 or not csv_path.is_file():
            err = PerfError(f"perf_analyzer at concurrency {c} failed ({r.returncode}): "
                            f"{(r.stderr or r.stdout).strip()[-1500:]}")
            if not keep_going:
                raise err
            log(str(err))
            rows.append({"concurrency": c, "error": str(err)})
            continue
        row = parse_csv(csv_path)
        row["audio_s_per_s"] = row["throughput_utt_s"] * mean_audio_s(frames)
        log(f"perf_analyzer concurrency {c}: {row['throughput_utt_s']:.1f} utt/s ({row['audio_s_per_s']:.1f} s of "
            f"audio/s), p50 {row['latency_p50_ms']:.0f} ms, "
            f"p99 {row['latency_p99_ms']:.0f} ms")
        rows.append(row)
    return rows


def failed_row(r: dict) -> str:
    """A table row of a level that failed (`run(keep_going=True)`): its concurrency and the tool's last words."""
    words = r["error"].strip().splitlines()[-1].replace("|", "/")
    return f"| {r['concurrency']} | failed: {words} | | | | |"


def to_markdown(rows: list[dict], frames, url: str) -> str:
    entries = entry_frames(frames)
    what = (f"{entries[0]} forced frames per request" if len(entries) == 1 else
            f"forced frames per request in turn from {len(entries)} lengths spread over {Lengths.of(frames)} "
            f"({', '.join(map(str, entries))})")
    out = [f"perf_analyzer against `chattts` at {url}, {what}, gRPC, time windows; audio s/s = utterances/s × "
           f"the entries' mean audio ({mean_audio_s(frames):.2f} s).", "",
           "| concurrency | utterances/s | audio s/s | p50 ms | p90 ms | p99 ms |", "|---|---|---|---|---|---|"]
    def f(v):
        return "" if v is None else f"{v:.0f}"
    out += [failed_row(r) if "error" in r else
            f"| {r['concurrency']} | {r['throughput_utt_s']:.1f} | "
            f"{r['throughput_utt_s'] * mean_audio_s(frames):.1f} | "
            f"{f(r['latency_p50_ms'])} | {f(r['latency_p90_ms'])} | {f(r['latency_p99_ms'])} |" for r in rows]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.perf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port of a running server")
    ap.add_argument("--concurrency", default="1,8,64,256", help="comma-separated levels, one run each")
    ap.add_argument("--frames", type=lengths_arg, default=Lengths(150, 150),
                    help=f"code frames per request (≈ 21.3 ms of audio each): N, or A-B for {ENTRIES} lengths spread "
                         "over it")
    ap.add_argument("--window-ms", type=int, default=5000, help="perf_analyzer's measurement window")
    ap.add_argument("--stability", type=int, default=25, help="perf_analyzer's --stability-percentage")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "perf")
    ap.add_argument("--prepare-only", action="store_true", help="fetch the binary and its libraries, then stop")
    a = ap.parse_args(argv)
    try:
        levels = [int(c) for c in a.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error("--concurrency must be whole numbers, comma-separated")
    if not levels or min(levels) < 1:
        ap.error("--concurrency needs levels of at least 1")
    try:
        binary = prepare()
        if a.prepare_only:
            print(binary)
            return 0
        a.out.mkdir(parents=True, exist_ok=True)
        rows = run(a.url, levels, a.frames, a.out, a.window_ms, binary, stability=a.stability)
    except PerfError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    (a.out / "perf.json").write_text(json.dumps({"url": a.url, "frames": str(a.frames),
                                                 "entry_frames": entry_frames(a.frames),
                                                 "rows": rows}, indent=1))
    md = to_markdown(rows, a.frames, a.url)
    (a.out / "perf.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
