"""The pronunciation lexicon over HTTP: the entries every gateway and Triton instance of the voice store applies
(chattts_triton/runtime/lexicon.py: the store's "lexicon" namespace, or the repository's lexicon.json; the rules of
chattts_triton/model/lexicon.py; docs/ssml.md#pronunciation-lexicon).

    GET    /v1/audio/lexicon          every entry: {"object": "list", "entries": [{"word", "say", "ignore_case"}]}
    GET    /v1/audio/lexicon/{word}   one entry
    PUT    /v1/audio/lexicon          add or replace one (admin): JSON {"word", "say", "ignore_case"?}
    POST   /v1/audio/lexicon          add one (admin): the same body; a word it has is 409 unless "replace": true
    DELETE /v1/audio/lexicon/{word}   remove one (admin)

Writes follow the voices' admin-key rule (voices_http.authorize_write). Every fault of a write is a 4xx naming the
field (OpenAI's error body) and changes nothing; a write is one transaction of the store, applied by every
chattts_preprocess and chattts_stream of the store from their first request after its poll interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from chattts_triton.model.lexicon import Entry, LexiconError, check_entry, entry_of
from chattts_triton.runtime import lexicon as L
from chattts_triton.runtime import stores
from chattts_triton.runtime import voices as V

from . import api
from .voices_http import authorize_write, bounded_body

log = logging.getLogger("chattts_gateway")

MAX_BODY_BYTES = 16 << 10  # an entry is at most 64 + 256 characters (≈ 4 KB as JSON escapes)
FIELDS = ("word", "say", "ignore_case", "replace")


def _shown(value: str, limit: int = 70) -> str:
    return value if len(value) <= limit else value[:limit - 3] + "..."


def _invalid(message: str, param: str | None, code: str | None = None) -> api.APIError:
    return api.invalid(message, param, code)


def _not_found(word: str) -> api.APIError:
    return api.APIError(404, f"no lexicon entry {_shown(word)!r} (GET /v1/audio/lexicon lists them)",
                        "invalid_request_error", "word", "lexicon_entry_not_found")


def _store_failed(e: stores.StoreError) -> api.APIError:
    if isinstance(e, stores.StoreUnavailable):
        return api.APIError(503, f"the voice store is unavailable, retry later ({e})", "server_error", None,
                            "voice_store_unavailable", {"Retry-After": "1"})
    return api.APIError(500, f"the lexicon's store failed: {e}", "server_error", None, "voice_store_error")


def entry_json(entry: Entry) -> dict[str, Any]:
    return {"object": "lexicon.entry", "word": entry.word, "say": entry.say, "ignore_case": entry.ignore_case}


def checked_entry(raw: Any) -> tuple[Entry, bool | None]:
    """(the entry, `replace` as sent or None) of a body; APIError(400) naming the field at fault."""
    if not isinstance(raw, dict):
        raise _invalid(f"the body must be a JSON object, got {type(raw).__name__}", None)
    for key in raw:
        if key not in FIELDS:
            raise _invalid(f"'{_shown(str(key), 40)}' is not a field of a lexicon entry (fields: word, say, "
                           f"ignore_case, replace)", _shown(str(key), 40))
    for key in ("word", "say"):
        if key not in raw:
            raise _invalid(f"'{key}' is a required property", key)
        if not isinstance(raw[key], str):
            raise _invalid(f"'{key}' must be a string, got {type(raw[key]).__name__}", key)
    replace = raw.get("replace")
    if replace is not None and not isinstance(replace, bool):
        raise _invalid(f"'replace' must be true or false, got {type(replace).__name__}", "replace")
    try:
        entry = check_entry(raw["word"], raw["say"], raw.get("ignore_case", False))
    except LexiconError as e:
        message = str(e).replace(repr(raw["word"]), repr(_shown(raw["word"])))
        raise _invalid(f"'{e.field}': {message}", e.field, "invalid_lexicon_entry") from None
    return entry, replace


class LexiconAPI:
    """The routes' work over the lexicon of the gateway's voice store (None: no store configured, an empty
    lexicon read-only)."""

    def __init__(self, gw):
        self.gw = gw
        settings = gw.settings
        url = V.store_url(settings.repo, settings.voice_store)
        self.store: stores.DocumentStore | None = None
        if url or settings.repo is not None:
            self.store = L.open_lexicon_store(url, settings.repo)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def writable(self) -> stores.DocumentStore:
        if self.store is None:
            raise api.APIError(501, "this gateway has no voice store, so no lexicon to edit: start it with "
                                    "--voice-store URL (or --repo REPO, the repository's lexicon.json)",
                               "invalid_request_error", None, "voice_store_not_configured")
        return self.store

    async def docs(self) -> stores.Docs:
        if self.store is None:
            return {}
        try:
            return (await asyncio.to_thread(self.store.snapshot))[1]
        except stores.StoreError as e:
            raise _store_failed(e) from None

    async def listing(self) -> list[dict[str, Any]]:
        lexicon, broken = L.lexicon_of(await self.docs())
        if broken:
            log.error("pronunciation lexicon: entries left out: %s", broken)
        return [entry_json(e) for e in lexicon.entries()]

    async def one(self, word: str) -> dict[str, Any]:
        doc = (await self.docs()).get(word)
        if doc is None:
            raise _not_found(word)
        try:
            return entry_json(entry_of(word, doc))
        except LexiconError as e:
            raise api.APIError(500, f"lexicon entry {_shown(word)!r} is unreadable: {e}", "server_error", None,
                               "lexicon_entry_unreadable") from None

    async def put(self, request: Request, replace_by_default: bool) -> JSONResponse:
        authorize_write(self.gw, request)
        store = self.writable()
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise api.APIError(415, f"Content-Type {kind or '(none)'!r}: a lexicon entry is application/json "
                                    f'{{"word", "say", "ignore_case"}}', "invalid_request_error", "Content-Type",
                               "unsupported_media_type")
        body = await bounded_body(request, MAX_BODY_BYTES, None, "a lexicon entry is small")
        try:
            raw = json.loads(body)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise _invalid(f"the body must be a JSON object ({why})", None) from None
        entry, replace = checked_entry(raw)
        replace = replace_by_default if replace is None else replace
        try:
            replaced = await asyncio.to_thread(L.put_entry, store, entry, replace)
        except L.EntryConflict as e:
            raise api.APIError(409, f"'word': {e}", "invalid_request_error", "word", "lexicon_conflict") from None
        except stores.Exists:
            raise api.APIError(409, f"'word': the lexicon has an entry {_shown(entry.word)!r}; PUT replaces it (or "
                                    f"send \"replace\": true)", "invalid_request_error", "word",
                               "lexicon_entry_exists") from None
        except stores.Full as e:
            raise api.APIError(409, f"the lexicon is full: {e}; DELETE an entry first", "invalid_request_error",
                               "word", "lexicon_full") from None
        except stores.StoreError as e:
            raise _store_failed(e) from None
        log.info("lexicon entry %r %s", entry.word, "replaced" if replaced else "added")
        return JSONResponse(entry_json(entry), status_code=200 if replaced else 201)

    async def delete(self, request: Request, word: str) -> dict[str, Any]:
        authorize_write(self.gw, request)
        store = self.writable()
        try:
            gone = await asyncio.to_thread(store.delete, word)
        except stores.StoreError as e:
            raise _store_failed(e) from None
        if not gone:
            raise _not_found(word)
        log.info("lexicon entry %r removed", word)
        return {"object": "lexicon.entry", "word": word, "deleted": True}


def install(app: FastAPI, gw) -> LexiconAPI:
    """The routes on `app`, over the gateway `gw`'s settings and authentication."""
    lexicon = LexiconAPI(gw)
    app.state.lexicon = lexicon

    @app.get("/v1/audio/lexicon")
    async def list_entries(request: Request):
        gw.authenticate(request)
        return {"object": "list", "entries": await lexicon.listing()}

    @app.get("/v1/audio/lexicon/{word:path}")
    async def get_entry(word: str, request: Request):
        gw.authenticate(request)
        return await lexicon.one(word)

    @app.put("/v1/audio/lexicon")
    async def put_entry(request: Request):
        return await lexicon.put(request, replace_by_default=True)

    @app.post("/v1/audio/lexicon")
    async def post_entry(request: Request):
        return await lexicon.put(request, replace_by_default=False)

    @app.delete("/v1/audio/lexicon/{word:path}")
    async def delete_entry(word: str, request: Request):
        return await lexicon.delete(request, word)

    return lexicon
