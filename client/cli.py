"""`python -m client`: synthesise one text to a WAV file, or one WAV per line of a text file.

Every optional input of the `chattts` contract is a flag (TOP_P -> --top-p, booleans as
--refine-text / --no-refine-text); flags left out use the server's defaults.
`--stream` (with TEXT) uses the decoupled `chattts_stream` model and writes the WAV as the chunks
arrive (sizes in the header are patched at the end; on failure the partial file is deleted).
`--show-spoken-text` (with TEXT) prints what the server voices for each piece (numbers in words, ...).
Exit status: 0 success, 1 a request failed or the server is unreachable, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .audio import FORMATS, WavError, WavStreamWriter, load_reference_audio, save_wav
from .balancer import BalancedChatTTSClient
from .client import (
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_URLS,
    PROTOCOLS,
    ChatTTSClient,
)
from .contract import MODEL, OPTION_FIELDS, OPTION_INPUTS, SAMPLE_RATE, STREAM_MODEL, SynthesisOptions, input_datatype
from .errors import ChatTTSError, ChatTTSInputError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SPEAKER_AUDIO_KEYWORD = "speaker_audio"  # a WAV path on the command line, samples in the request
AT_FILE_KEYWORDS = ("speaker", "speaker_sample")  # long strings: "@FILE" reads them from a file


def _flag(keyword: str) -> str:
    return "--" + keyword.replace("_", "-")


def _add_contract_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("synthesis options (SynthesisOptions fields, contract inputs; omitted = server "
                                      "default)")
    server_defaults = SynthesisOptions.server_defaults()
    for keyword in OPTION_FIELDS:
        name = OPTION_INPUTS[keyword]
        datatype = input_datatype(name)
        default = server_defaults[keyword]
        about = name if default is None else f"{name} (server default {default!r})"
        if keyword == SPEAKER_AUDIO_KEYWORD:
            group.add_argument(_flag(keyword), metavar="WAV", help=f"{name}: reference voice, {SAMPLE_RATE} Hz WAV")
        elif datatype == "BOOL":
            group.add_argument(_flag(keyword), action=argparse.BooleanOptionalAction, default=None, help=about)
        elif datatype == "BYTES":
            extra = " (or @FILE to read it from a file)" if keyword in AT_FILE_KEYWORDS else ""
            group.add_argument(_flag(keyword), metavar="STR", help=f"{about}{extra}")
        elif datatype.startswith(("INT", "UINT")):
            group.add_argument(_flag(keyword), type=int, metavar="N", help=about)
        elif datatype.startswith("FP"):
            group.add_argument(_flag(keyword), type=float, metavar="X", help=about)
        else:  # a contract change this CLI does not understand yet
            raise NotImplementedError(f"no command-line flag for {name} ({datatype})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m client",
        description="Text to speech with the chattts model on a Triton server.",
        epilog="Exit status: 0 ok, 1 request failed / server unreachable, 2 bad arguments.",
    )
    p.add_argument("text", nargs="?", help="text to speak ('-' reads standard input)")
    p.add_argument("-o", "--output", metavar="WAV", help="output WAV file (with TEXT)")
    p.add_argument("--file", metavar="TXT", help="UTF-8 text file: one utterance per non-empty line")
    p.add_argument("--out-dir", metavar="DIR", help="where --file writes 0001.wav, 0002.wav, ... (by line number)")
    p.add_argument(
        "--url",
        help=f"HOST:PORT (default {DEFAULT_URLS['grpc']} for grpc, {DEFAULT_URLS['http']} for http); "
        "several comma-separated: balanced across them with failover",
    )
    p.add_argument("--protocol", choices=PROTOCOLS, default="grpc")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S", help="per request attempt")
    p.add_argument("--retries", type=int, default=DEFAULT_RETRIES, help="on UNAVAILABLE / connection errors only")
    p.add_argument("--backoff", type=float, default=DEFAULT_BACKOFF_S, metavar="S", help="first retry delay (doubles)")
    p.add_argument("--concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY, help="requests in flight at once")
    p.add_argument("--format", choices=FORMATS, default="pcm16", help="WAV sample format")
    p.add_argument("--no-split", dest="split", action="store_false", help="send TEXT as one utterance")
    p.add_argument(
        "--no-voice-from-first",
        dest="voice_from_first",
        action="store_false",
        help="do not use the first sentence as the voice reference of the others",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument("--stream", action="store_true", help="with TEXT: stream from --stream-model, WAV written as it "
                                                         "comes")
    p.add_argument("--stream-model", default=STREAM_MODEL)
    p.add_argument("--chunk-timeout", type=float, metavar="S",
                   help="with --stream: seconds per chunk (default --timeout)")
    p.add_argument("--show-spoken-text", action="store_true",
                   help="with TEXT: print the text the server voices for each piece (SPOKEN_TEXT: numbers, dates and "
                        "money in words, characters it cannot say removed)")
    _add_contract_options(p)
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.text is None) == (args.file is None):
        p.error("give either TEXT or --file")
    if args.text is not None and not args.output:
        p.error("TEXT needs -o/--output")
    if args.text is not None and args.out_dir:
        p.error("--out-dir goes with --file (use -o for TEXT)")
    if args.file is not None and not args.out_dir:
        p.error("--file needs --out-dir")
    if args.file is not None and args.output:
        p.error("-o goes with TEXT (use --out-dir for --file)")
    if args.timeout <= 0 or args.retries < 0 or args.backoff < 0 or args.concurrency < 1:
        p.error("--timeout and --concurrency must be positive, --retries and --backoff not negative")
    if args.stream and args.file is not None:
        p.error("--stream goes with TEXT, not --file")
    if args.chunk_timeout is not None and (not args.stream or args.chunk_timeout <= 0):
        p.error("--chunk-timeout must be positive and goes with --stream")
    if args.show_spoken_text and args.file is not None:
        p.error("--show-spoken-text goes with TEXT, not --file")


def _options(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The flags' option values (files read); `SynthesisOptions.of` checks them."""
    options = {k: getattr(args, k) for k in OPTION_FIELDS if getattr(args, k) is not None}
    try:
        if SPEAKER_AUDIO_KEYWORD in options:
            options[SPEAKER_AUDIO_KEYWORD] = load_reference_audio(options[SPEAKER_AUDIO_KEYWORD])
        for keyword in AT_FILE_KEYWORDS:
            if str(options.get(keyword, "")).startswith("@"):
                options[keyword] = Path(options[keyword][1:]).read_text(encoding="utf-8").strip()
    except (OSError, WavError) as e:
        p.error(str(e))
    return options


def _read_lines(p: argparse.ArgumentParser, path: str) -> list[tuple]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        p.error(f"cannot read --file {path}: {e}")
    numbered = [(n, line.strip()) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        p.error(f"--file {path} has no non-empty lines")
    return numbered


def _spoken_printer(args, out):
    """--show-spoken-text: each piece's SPOKEN_TEXT on its own line of `out`."""
    if not args.show_spoken_text:
        return None
    return lambda text: print(f"spoken: {text}", file=out, flush=True)


def _run_text(client: ChatTTSClient, args, options, out) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    start = time.perf_counter()
    audio = client.synthesize(text, options, split=args.split, voice_from_first=args.voice_from_first,
                              on_spoken_text=_spoken_printer(args, out))
    path = save_wav(args.output, audio, fmt=args.format)
    if not args.quiet:
        print(f"wrote {path}: {audio.size / SAMPLE_RATE:.2f} s of audio in {time.perf_counter() - start:.2f} s",
              file=out)
    return EXIT_OK


def _run_stream(client: ChatTTSClient, args, options, out) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    start = time.perf_counter()
    stream = client.stream(
        text, options, split=args.split, voice_from_first=args.voice_from_first, chunk_timeout_s=args.chunk_timeout,
        on_spoken_text=_spoken_printer(args, out),
    )
    progress = not args.quiet and sys.stderr.isatty()
    first = None
    # on any failure the WAV is deleted, then the stream closed (which cancels the request)
    with contextlib.closing(stream) as chunks, WavStreamWriter(args.output, fmt=args.format) as wav:
        for chunk in chunks:
            if first is None:
                first = time.perf_counter() - start
            wav.write(chunk)
            if progress:
                print(f"\r{wav.samples / SAMPLE_RATE:7.2f} s of audio received (first chunk after {first:.2f} s)",
                      end="", file=sys.stderr, flush=True)  # fmt: skip
    if progress:
        print(file=sys.stderr)
    if not args.quiet:
        ttfc = "no audio" if first is None else f"first chunk after {first:.2f} s"
        print(f"wrote {wav.path}: {wav.samples / SAMPLE_RATE:.2f} s of audio in {time.perf_counter() - start:.2f} s"
              f" ({ttfc})", file=out)  # fmt: skip
    return EXIT_OK


class _NoBar:
    def __init__(self, *args, **kwargs):
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _run_file(client: ChatTTSClient, args, options, numbered, out) -> int:
    try:
        from tqdm import tqdm
    except ImportError:  # the client package needs no tqdm (extra "progress"): then no bar
        tqdm = _NoBar

    if not client.is_ready():
        print(f"error: {client.where} is unreachable or not ready", file=sys.stderr)
        return EXIT_FAILED
    out_dir = Path(args.out_dir)
    width = max(4, len(str(numbered[-1][0])))
    failures: list[str] = []
    bar = tqdm(total=len(numbered), unit="utt", disable=args.quiet, file=sys.stderr)

    def on_result(i: int, result) -> None:
        line_no = numbered[i][0]
        if isinstance(result, ChatTTSError):
            failures.append(f"line {line_no}: {result}")
        else:
            save_wav(out_dir / f"{line_no:0{width}d}.wav", result, fmt=args.format)
        bar.update(1)

    texts = [text for _, text in numbered]
    try:
        client.synthesize_batch(texts, options, return_exceptions=True, on_result=on_result)
    finally:
        bar.close()
    for line in sorted(failures):
        print(f"error: {line}", file=sys.stderr)
    if not args.quiet:
        print(f"wrote {len(numbered) - len(failures)} of {len(numbered)} WAV files to {out_dir}", file=out)
    return EXIT_FAILED if failures else EXIT_OK


def main(argv: Sequence[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    p = build_parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    options = _options(p, args)
    numbered = _read_lines(p, args.file) if args.file is not None else None
    try:
        several = args.url is not None and "," in args.url
        client = (BalancedChatTTSClient if several else ChatTTSClient)(
            args.url,
            protocol=args.protocol,
            model=args.model,
            timeout_s=args.timeout,
            retries=args.retries,
            backoff_s=args.backoff,
            max_concurrency=args.concurrency,
            stream_model=args.stream_model,
        )
    except ValueError as e:
        p.error(str(e))
    try:
        with client:
            options = SynthesisOptions.of(options)  # a bad value: INVALID_ARGUMENT, as the server would say
            if numbered is not None:
                return _run_file(client, args, options, numbered, out)
            if args.stream:
                return _run_stream(client, args, options, out)
            return _run_text(client, args, options, out)
    except ChatTTSInputError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    except ChatTTSError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:  # writing the WAV
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
