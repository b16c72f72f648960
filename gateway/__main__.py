"""`python -m gateway`: the OpenAI-compatible speech gateway in front of a running Triton server.

    python -m gateway --grpc-url 127.0.0.1:8001 --port 8080 --repo build/repo      # make gateway

Binds 127.0.0.1 unless told otherwise; on another address it warns when no API key is set, and with
--require-api-key refuses to start without one. Keys: --api-key KEY (repeatable), --api-key-file FILE (one
per line) or CHATTTS_GATEWAY_API_KEYS=KEY1,KEY2 (never logged). --workers N: N processes on the port (default 2).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from chattts_triton.config import VOICE_STORE_ENV

from .app import DEFAULT_WORKERS, Settings
from .voices_http import ADMIN_KEY_ENV, is_loopback

KEYS_ENV = "CHATTTS_GATEWAY_API_KEYS"
log = logging.getLogger("chattts_gateway")


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--grpc-url", default=d.grpc_url, help="Triton's gRPC HOST:PORT (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s; 0.0.0.0 for every "
                                                       "interface)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--repo", type=Path, help="the served model repository: its voice store setting (else its "
                                             "voices.json) "
                                             "for /v1/audio/voices, and its model's speaker size")
    p.add_argument("--voice-store", metavar="URL", default=None,
                   help=f"the voice store /v1/audio/voices reads and writes, the one the server reads (sqlite:///PATH, "
                        f"redis://HOST:PORT/DB, postgresql://USER@HOST/DB; docs/voices.md); default: env "
                        f"{VOICE_STORE_ENV}, else --repo's setting, else --repo's voices.json")
    p.add_argument("--admin-key", default=None, metavar="KEY",
                   help=f"the key writes to the voice store need ('Authorization: Bearer KEY'); default: env "
                        f"{ADMIN_KEY_ENV}; without one, writes are taken only on a loopback --host")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY", help="accept 'Authorization: Bearer KEY'")
    p.add_argument("--api-key-file", type=Path, help="API keys, one per line")
    p.add_argument("--require-api-key", action="store_true",
                   help="refuse to start on a non-loopback host without a key")
    p.add_argument("--timeout", type=float, default=d.timeout_s, metavar="S",
                   help="a whole synthesis; a stream: each chunk")
    p.add_argument("--channels", type=int, default=d.channels, help="gRPC connections to Triton")
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency,
                   help="speech requests in flight before 429")
    p.add_argument("--piece-concurrency", type=int, default=d.piece_concurrency,
                   help="pieces (sentences) of one long input synthesised at once")
    p.add_argument("--pause-ms", type=int, default=d.pause_ms, help="silence between the pieces of a long input")
    p.add_argument("--stream-default", action=argparse.BooleanOptionalAction, default=d.stream_default,
                   help="stream audio when a request does not say (its 'stream' field)")
    p.add_argument("--keep-alive-s", type=float, default=75.0, metavar="S",
                   help="how long an idle HTTP connection stays open (default %(default)s): longer than client pools "
                        "and load balancers keep theirs (60 s is common), so a pooled connection is not closed under "
                        "a request (uvicorn's own 5 s can close one as a pooled client reuses it)")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                   help="gateway processes sharing the port (uvicorn's workers), each with its own event loop and gRPC "
                        "connections, for more requests/s than one core's loop carries; --max-concurrency is per "
                        "process; /metrics sums them all (default %(default)s)")
    p.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def api_keys(a: argparse.Namespace) -> list[str]:
    keys = list(a.api_key)
    if a.api_key_file is not None:
        keys += [line.strip() for line in a.api_key_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    keys += [k.strip() for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip()]
    return keys


def main(argv=None) -> int:  # noqa: C901  a command's main: its flags checked in order, then uvicorn started
    p = build_parser()
    a = p.parse_args(argv)
    for name in ("channels", "max_concurrency", "piece_concurrency", "workers"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1")
    if a.timeout <= 0 or a.pause_ms < 0 or a.keep_alive_s <= 0:
        p.error("--timeout and --keep-alive-s must be > 0 and --pause-ms ≥ 0")
    try:
        keys = api_keys(a)
    except OSError as e:
        p.error(f"--api-key-file: {e}")
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(a.host) and not keys:
        if a.require_api_key:
            p.error(f"--host {a.host} is not loopback and --require-api-key is set: give --api-key, --api-key-file or "
                    f"{KEYS_ENV}")
        log.warning("binding %s without an API key: anyone who reaches this port can synthesise speech "
                    "(set --api-key / %s, or --require-api-key to refuse this)", a.host, KEYS_ENV)
    if a.repo is not None and not (a.repo / "manifest.json").is_file():
        p.error(f"--repo {a.repo}: no manifest.json, not an exported model repository")
    from chattts_triton.runtime.stores import StoreError, shown_url
    from chattts_triton.runtime.voices import open_voice_store, store_url

    voice_store = store_url(a.repo, a.voice_store)
    if voice_store or a.repo is not None:
        try:  # a URL that names no store fails here, not at the first request
            store = open_voice_store(voice_store, a.repo)
        except StoreError as e:
            p.error(f"--voice-store: {e}")
        log.info("voice store: %s", shown_url(store.url))
        store.close()
    admin_key = (a.admin_key if a.admin_key is not None else os.environ.get(ADMIN_KEY_ENV, "")).strip()
    if not admin_key and not is_loopback(a.host):
        log.warning("no admin key on %s: POST and DELETE /v1/audio/voices answer 403 (set --admin-key / %s)", a.host,
                    ADMIN_KEY_ENV)
    settings = Settings(grpc_url=a.grpc_url, repo=a.repo, api_keys=tuple(keys), timeout_s=a.timeout,
                        channels=a.channels, max_concurrency=a.max_concurrency, piece_concurrency=a.piece_concurrency,
                        pause_ms=a.pause_ms, stream_default=a.stream_default, voice_store=voice_store,
                        admin_key=admin_key, host=a.host)

    import uvicorn

    from .app import SETTINGS_ENV, create_app, tune_malloc
    from .metrics import MULTIPROC_ENV

    try:
        import httptools  # noqa: F401  the C HTTP parser: less CPU per request than h11
        http = "httptools"
    except ImportError:
        http = "h11"
    log.info("speech gateway on http://%s:%d → Triton gRPC %s (API keys: %s)", a.host, a.port, a.grpc_url,
             len(keys) or "none")
    common = dict(host=a.host, port=a.port, http=http, loop="asyncio", log_level=a.log_level, access_log=a.access_log,
                  timeout_keep_alive=a.keep_alive_s, timeout_graceful_shutdown=int(min(a.timeout, 60)))
    if a.workers == 1:
        tune_malloc()
        uvicorn.run(create_app(settings), **common)
        return 0
    # each worker is a fresh interpreter that builds its app from the environment (uvicorn's factory); their
    # metrics meet in files, in a folder of this run's own unless PROMETHEUS_MULTIPROC_DIR names one
    before = {k: os.environ.get(k) for k in (SETTINGS_ENV, MULTIPROC_ENV)}
    os.environ[SETTINGS_ENV] = settings.to_json()
    own = not os.environ.get(MULTIPROC_ENV)
    folder = Path(tempfile.mkdtemp(prefix="chattts-gateway-metrics-") if own else os.environ[MULTIPROC_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):  # a previous run's values would be summed with this one's
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(folder)
    try:
        uvicorn.run("gateway.app:app_from_env", factory=True, workers=a.workers, **common)
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
        for k, v in before.items():  # main() called in a process that goes on (tests) leaves its environment as it was
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0


if __name__ == "__main__":
    sys.exit(main())
