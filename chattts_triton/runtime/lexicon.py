"""The pronunciation lexicon, kept where the voices are (runtime/stores.py, the `voice_store` URL): by default the
repository's `lexicon.json` beside voices.json; `lexicon.json` beside the file a file:// store names; the namespace
"lexicon" of an SQLite, Redis or PostgreSQL store (one document per word). Every model that prepares a request
(`chattts_preprocess`, `chattts_stream`) reads it, so every replica serving the store shares it. The matching rules are
chattts_triton.model.lexicon's; docs/ssml.md#pronunciation-lexicon is the user's guide.

    python -m chattts_triton.lexicon --repo REPO list
    python -m chattts_triton.lexicon --repo REPO add 重庆 虫庆
    python -m chattts_triton.lexicon --repo REPO add nvidia "en vidia" --ignore-case
    python -m chattts_triton.lexicon --repo REPO remove 重庆
    python -m chattts_triton.lexicon --repo REPO apply "重庆的银行"     # what the lexicon makes of a text
    python -m chattts_triton.lexicon --voice-store redis://HOST:6379/0 import REPO/lexicon.json

Edits are atomic (lexicon.json: written aside, renamed over it, under the lock on its folder the voices CLI takes; a
server: one transaction); a running server sees them as it sees the voices' (a file's identity is checked at each
request, a server's generation at most every stores.POLL_S seconds: stores.Follower). A lexicon that cannot be read (a
hand edit gone wrong) is logged and the last good version stays in use, as do the entries read last while a store's
server is down; an entry that cannot be used is logged and left out. None: no lexicon. The gateway manages it over
HTTP (gateway/lexicon_http.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from ..config import LEXICON, VOICE_STORE_ENV
from ..model.lexicon import (
    FORMAT,
    MAX_ENTRIES,
    Entry,
    Lexicon,
    LexiconError,
    check_entry,
    entry_of,
    fold_case,
    from_json,
    listing_order,
    to_json,
)
from .stores import (
    Docs,
    DocumentStore,
    Exists,
    FileStore,
    Follower,
    Full,
    StoreError,
    file_store_path,
    open_server_store,
    shown_url,
    write_json_atomically,
)

log = logging.getLogger(__name__)

NAMESPACE = "lexicon"  # the lexicon's namespace in a shared store, beside the voices'


class LexiconFileError(StoreError):
    """A lexicon.json that cannot be read, or is no lexicon: a server-side fault."""


class EntryConflict(LexiconError):
    """Another word's ignore_case entry matches the same spellings."""


# --- where it is kept -------------------------------------------------------------------------------------------
def _file_docs(text: str, path) -> Docs:
    """The entries of a lexicon.json's text (word -> its JSON object), its format checked (each entry: `lexicon_of`)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise LexiconFileError(f"{path} cannot be read: {e}") from None
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), Mapping):
        raise LexiconFileError(f'{path} is not a lexicon ({{"format": {FORMAT}, "entries": {{"word": {{"say": "..."}}, '
                               f'...}}}})')
    return dict(doc["entries"])


def _render(docs: Docs) -> dict:
    return {"format": FORMAT, "entries": {w: docs[w] for w in sorted(docs, key=listing_order)}}


class FileLexiconStore(FileStore):
    """A lexicon.json, edited under the lock on its folder (the voices' file store's)."""

    def __init__(self, path: Path):
        super().__init__(path, NAMESPACE, _file_docs, _render, max_docs=MAX_ENTRIES, error=LexiconFileError)


def open_lexicon_store(url: str = "", repo: Path | None = None) -> DocumentStore:
    """The lexicon of the voice store `url` names (runtime/stores.py); empty: `repo`'s lexicon.json."""
    url = (url or "").strip()
    if not url:
        if repo is None:
            raise StoreError("no lexicon: give voice_store a URL, or the model repository")
        return FileLexiconStore(Path(repo) / LEXICON)
    if urlsplit(url).scheme.lower() == "file":
        voices = file_store_path(url)
        if voices.name == LEXICON:
            raise StoreError(f"voice_store {url!r}: the lexicon is kept beside the voices' file as {LEXICON}: name "
                             f"the voices' file otherwise (voices.json)")
        return FileLexiconStore(voices.parent / LEXICON)
    return open_server_store(url, NAMESPACE, dict, MAX_ENTRIES)


def lexicon_of(docs: Docs) -> tuple[Lexicon, dict[str, str]]:
    """(the lexicon, why each entry left out is) of a store's documents: an entry that is none, and the later (in
    listing order) of two ignore_case entries of one folded spelling (two writers at once; a write refuses it)."""
    entries, broken, folded = [], {}, {}
    for word in sorted(docs, key=listing_order):
        try:
            entry = entry_of(word, docs[word])
        except LexiconError as e:
            broken[word] = str(e)
            continue
        if entry.ignore_case:
            other = folded.setdefault(fold_case(word), word)
            if other != word:
                broken[word] = f"lexicon word {word!r} matches what {other!r} matches (both ignore case)"
                continue
        entries.append(entry)
    return Lexicon(entries), broken


def read_lexicon(path: Path) -> Lexicon:
    """The lexicon in the file `path`, every entry usable; LexiconError saying why it cannot be used."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LexiconError(f"{path} cannot be read: {e}") from None
    try:
        return from_json({"format": FORMAT, "entries": _file_docs(text, path)})
    except LexiconFileError as e:
        raise LexiconError(str(e)) from None
    except LexiconError as e:
        raise LexiconError(f"{path}: {e}") from None


def write_lexicon(path: Path, lexicon: Lexicon) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    write_json_atomically(Path(path), to_json(lexicon))


@contextlib.contextmanager
def editing(repo: Path) -> Iterator[dict]:
    """The entries of `repo`'s lexicon.json (word -> Entry) to change in place; written back when the block ends
    without an error. Serialised with every other edit of the repository by a lock on its folder."""
    store = FileLexiconStore(Path(repo) / LEXICON)
    with store.editing() as docs:
        entries = {e.word: e for e in from_json({"format": FORMAT, "entries": docs}).entries()}
        yield entries
        lexicon = Lexicon(entries.values())  # two entries of one spelling: refused before anything is written
        docs.clear()
        docs.update({e.word: e.to_json() for e in lexicon.entries()})


# --- one entry's edits (the CLI's and the gateway's) --------------------------------------------------------------
def put_entry(store: DocumentStore, entry: Entry, replace: bool = False) -> bool:
    """Adds `entry` (with `replace`, in place of the word's entry); True where it replaced one. EntryConflict where
    another word's ignore_case entry matches the same spellings; stores.Exists, stores.Full; StoreError."""
    docs = store.snapshot()[1]
    if entry.ignore_case:
        key = fold_case(entry.word)
        for word, doc in docs.items():
            if word != entry.word and fold_case(word) == key and isinstance(doc, Mapping) and doc.get("ignore_case"):
                raise EntryConflict(f"lexicon word {entry.word!r}: the entry of {word!r} ignores case and matches the "
                                    f"same spellings; remove it first", "word")
    store.put(entry.word, entry.to_json(), replace)
    return entry.word in docs


class LexiconRegistry:
    """The lexicon of a store (or `repo`'s lexicon.json) as of now, made again when the store changes."""

    def __init__(self, source: Path | DocumentStore):
        self.store = source if isinstance(source, DocumentStore) else open_lexicon_store("", Path(source))
        self._follower = Follower(self.store, self._build, "pronunciation lexicon", keep_last=True, empty=Lexicon())

    def _build(self, docs: Docs) -> Lexicon:
        lexicon, broken = lexicon_of(docs)
        if broken:
            log.error("pronunciation lexicon %s: entries left out: %s", shown_url(self.store.url), broken)
        return lexicon

    def current(self) -> Lexicon:
        return self._follower.current()[1]

    def apply(self, text: str) -> str:
        return self.current().apply(text)


# --- command line ------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m chattts_triton.lexicon",
                                 description="List, add and remove the pronunciation lexicon's entries: the voice "
                                             f"store's (REPO/{LEXICON} by default; docs/ssml.md).")
    ap.add_argument("--repo", type=Path, help=f"an exported model repository (its voice_store setting, its {LEXICON})")
    ap.add_argument("--voice-store", metavar="URL", default=None,
                    help=f"the voice store whose lexicon to edit (sqlite:///PATH, redis://..., postgresql://...; "
                         f"docs/voices.md); default: env {VOICE_STORE_ENV}, else the repository's voice_store "
                         f"setting, else REPO/{LEXICON}")
    sub = ap.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="the entries")
    ls.add_argument("--json", action="store_true", help=f"the lexicon as {LEXICON} holds it")
    add = sub.add_parser("add", help="add (or with --force replace) an entry")
    add.add_argument("word", help="the word as written (exact, case included)")
    add.add_argument("say", help="what to say instead: a homophone or a respelling (control tokens allowed)")
    add.add_argument("--ignore-case", action="store_true", help="match the word in any case of A-Z")
    add.add_argument("--force", action="store_true", help="replace the entry of that word")
    rm = sub.add_parser("remove", help="remove an entry")
    rm.add_argument("word")
    ap_apply = sub.add_parser("apply", help="print what the lexicon makes of a text")
    ap_apply.add_argument("text")
    imp = sub.add_parser("import", help=f"add every entry of a {LEXICON} (e.g. a repository's, to a shared store)")
    imp.add_argument("file", type=Path)
    imp.add_argument("--force", action="store_true", help="replace the entries of words the lexicon has")
    return ap


def _add(store: DocumentStore, entry: Entry, force: bool) -> None:
    try:
        put_entry(store, entry, replace=force)
    except Exists:
        said = (store.get(entry.word) or {}).get("say")
        raise LexiconError(f"the lexicon has {entry.word!r} (says {said!r}); --force replaces it") from None
    except Full as e:
        raise LexiconError(f"the lexicon is full: {e}") from None


def _run(a: argparse.Namespace, store: DocumentStore) -> None:
    if a.command in ("list", "apply"):
        lexicon, broken = lexicon_of(store.snapshot()[1])
        for why in broken.values():
            print(f"error: {why}", file=sys.stderr)
        if a.command == "apply":
            print(lexicon.apply(a.text))
        elif a.json:
            print(json.dumps(to_json(lexicon), indent=2, ensure_ascii=False))
        else:
            for e in lexicon.entries():
                print(f"{e.word}\t{e.say}" + ("\t(any case)" if e.ignore_case else ""))
    elif a.command == "add":
        entry = check_entry(a.word, a.say, a.ignore_case)
        _add(store, entry, a.force)
        print(f"added {entry.word} -> {entry.say}")
    elif a.command == "import":
        entries = read_lexicon(a.file).entries()
        for entry in entries:
            _add(store, entry, a.force)
        print(f"imported {len(entries)} entries from {a.file}")
    else:
        if not store.delete(a.word):
            raise LexiconError(f"the lexicon has no entry {a.word!r}")
        print(f"removed {a.word}")


def main(argv=None) -> int:
    from .voices import store_url  # one rule for the store's URL: --voice-store, env, the repository's setting

    ap = _parser()
    a = ap.parse_args(argv)
    if a.repo is not None and not a.repo.is_dir():
        print(f"error: {a.repo} is not a folder: --repo must be an exported repository (make export)", file=sys.stderr)
        return 1
    url = store_url(a.repo, a.voice_store)
    if not url and a.repo is None:
        ap.error(f"give --repo (its {LEXICON}, or its voice_store setting) or --voice-store (or env {VOICE_STORE_ENV})")
    try:
        store = open_lexicon_store(url, a.repo)
        try:
            _run(a, store)
        finally:
            store.close()
    except (LexiconError, StoreError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
