"""Where a registry of named JSON documents is kept (the voices: runtime/voices.py), chosen by one URL
(`voice_store`, docs/voices.md#stores):

    (empty)                      the repository's voices.json (runtime/voices.py FileVoiceStore): one machine
    file:///ABS/PATH/voices.json such a file elsewhere
    sqlite:///ABS/PATH.db        an SQLite database (WAL): one machine, several processes
    redis://[:PASSWORD@]HOST:PORT/DB[?prefix=NAME]      a Redis server (`redis` package): every replica
    postgresql://USER[:PASSWORD]@HOST:PORT/DB           a PostgreSQL server (psycopg 3): every replica

A store keeps, per namespace, a set of documents (name -> JSON object) and a generation: a counter that every
write raises in the same transaction as its change. A reader asks for the generation (one small read: a stat, a
SELECT of one row, a Redis GET) at most every `poll_s` seconds, and reads the whole set again only when it
changed; `snapshot` returns the set with its generation as one consistent read. So every process sees a write at
its first look after it, within `poll_s` (POLL_S = 0.25 s for a server, every time for a file or an SQLite
database on the same machine); a write is one transaction: a reader sees the old set or the new one, never a
document half-written. A store never written serves its `initial` documents (the built-in voices), and its first
write keeps them beside the new one.

Bounds: at most MAX_DOCS documents (a store's `max_docs` where its namespace holds more: the lexicon's entries), each
at most MAX_DOC_BYTES of JSON (UTF-8); names are the caller's to check.

One URL serves several namespaces: the voices ("voices", runtime/voices.py) and the pronunciation lexicon
("lexicon", runtime/lexicon.py) of a shared store; a file store is one JSON file per namespace (`FileStore`).
`Follower` is how a reader keeps what it made of a namespace current (the poll rule above), for both.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

log = logging.getLogger(__name__)

POLL_S = 0.25  # a server-backed store's generation is read at most this often per process
MAX_DOCS = 1000
MAX_DOC_BYTES = 32 << 10  # a voice of 15 s of reference audio with a long transcript is ≈ 16 KiB
SCHEMES = ("file", "sqlite", "redis", "rediss", "postgresql", "postgres")
CONNECT_TIMEOUT_S = 5.0

Docs = dict[str, dict]


class StoreError(RuntimeError):
    """The store holds something it should not (a server-side fault), or its URL is wrong."""


class StoreUnavailable(StoreError):
    """The store's server cannot be reached now: a reader keeps what it read last."""


class Exists(StoreError):
    """A document of that name exists and the write was not to replace it."""


class Full(StoreError):
    """The store holds MAX_DOCS documents already."""


def shown_url(url: str) -> str:
    """The URL without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[-1]}"))


def encode_doc(name: str, doc: dict) -> str:
    """A document as stored; StoreError past MAX_DOC_BYTES."""
    text = json.dumps(doc, ensure_ascii=False, sort_keys=True)
    if len(text.encode("utf-8")) > MAX_DOC_BYTES:
        raise StoreError(f"{name!r} is {len(text.encode('utf-8'))} bytes of JSON, more than the limit of "
                         f"{MAX_DOC_BYTES}")
    return text


def decode_doc(name: str, text) -> dict:
    try:
        doc = json.loads(text)
    except (TypeError, ValueError) as e:
        raise StoreError(f"{name!r} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise StoreError(f"{name!r} is not a JSON object")
    return doc


class DocumentStore:
    """A namespace of documents; `initial()` is what it holds before its first write; `max_docs` the most documents
    it may hold (None: MAX_DOCS, read at each write)."""

    poll_s: float = 0.0

    def __init__(self, url: str, namespace: str, initial: Callable[[], Docs] = dict, max_docs: int | None = None):
        self.url, self.namespace, self.initial, self.max_docs = url, namespace, initial, max_docs

    @property
    def limit(self) -> int:
        return self.max_docs or MAX_DOCS

    def __repr__(self) -> str:
        return f"{type(self).__name__}({shown_url(self.url)!r}, {self.namespace!r})"

    def generation(self) -> Hashable:
        """A token that changes with every write (cheap); StoreUnavailable when the server is down."""
        raise NotImplementedError

    def snapshot(self) -> tuple[Hashable, Docs]:
        """(generation, documents) as one consistent read."""
        raise NotImplementedError

    def put(self, name: str, doc: dict, replace: bool = False) -> None:
        """Adds (or with `replace` replaces) a document in one transaction; Exists, Full, StoreError."""
        raise NotImplementedError

    def delete(self, name: str) -> bool:
        """Removes a document in one transaction; False when there was none."""
        raise NotImplementedError

    def get(self, name: str) -> dict | None:
        return self.snapshot()[1].get(name)

    def close(self) -> None:
        pass

    def _seed(self) -> dict[str, str]:
        return {n: encode_doc(n, d) for n, d in self.initial().items()}


def check_room(name: str, exists: bool, count: int, replace: bool, limit: int | None = None) -> None:
    """Exists or Full where a write of `name` may not be made."""
    limit = limit or MAX_DOCS
    if exists and not replace:
        raise Exists(f"{name!r} exists")
    if not exists and count >= limit:
        raise Full(f"the store holds {count} entries, the most it may ({limit})")


# --- a JSON file -----------------------------------------------------------------------------------
def write_json_atomically(path: Path, doc: dict) -> None:
    """`doc` as `path` (indented UTF-8): written aside and renamed over it, so that a reader sees the old file or the
    new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, ensure_ascii=False)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder` (flock): every edit of a file in it, by any process, one at a time (the CLIs'
    edits of a repository's voices.json and lexicon.json take the same one)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class FileStore(DocumentStore):
    """A JSON file `{"format": F, KEY: {name: document}}` (a repository's voices.json or lexicon.json, or one a
    file:// URL names): its identity (a stat) is its generation; a write is the file written aside and renamed over
    it, under `folder_lock` of its folder. `parse(text, path)` reads the documents out of the file's text (StoreError
    where it is not such a file); `render(docs)` is the file's content."""

    def __init__(self, path: Path, namespace: str, parse: Callable[[str, Path], Docs], render: Callable[[Docs], dict],
                 initial: Callable[[], Docs] = dict, max_docs: int | None = None, error=StoreError):
        super().__init__(f"file://{Path(path).absolute()}", namespace, initial, max_docs)
        self.path, self.parse, self.render, self.error = Path(path), parse, render, error

    def generation(self) -> Hashable:
        try:
            st = os.stat(self.path)  # follows a configured view's symlink to the file it names
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_dev, st.st_mtime_ns, st.st_size

    def snapshot(self) -> tuple[Hashable, Docs]:
        try:
            with open(self.path, "rb") as f:  # the identity of the file read, not of one renamed over it since
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return None, self.initial()
        except OSError as e:
            raise self.error(f"{self.path} cannot be read: {e}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"{self.path} cannot be read: {e}") from None
        return (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_size), self.parse(text, self.path)

    @contextlib.contextmanager
    def editing(self) -> Iterator[Docs]:
        """The documents to change in place, written back when the block ends without an error (an error in the
        block, a refused write, leaves the file as it was)."""
        with folder_lock(self.path.parent):
            docs = dict(self.snapshot()[1])
            yield docs
            write_json_atomically(self.path, self.render(docs))

    def put(self, name: str, doc: dict, replace: bool = False) -> None:
        encode_doc(name, doc)  # within the size bound
        with self.editing() as docs:
            check_room(name, name in docs, len(docs), replace, self.limit)
            docs[name] = doc

    def delete(self, name: str) -> bool:
        with folder_lock(self.path.parent):
            docs = dict(self.snapshot()[1])
            if docs.pop(name, None) is None:
                return False  # nothing to delete: the file as it was
            write_json_atomically(self.path, self.render(docs))
        return True


def file_store_path(url: str) -> Path:
    """The file a file:///ABSOLUTE/PATH.json URL names; StoreError for any other file: URL."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path.endswith(".json"):
        raise StoreError(f"voice_store {url!r}: a file store is file:///ABSOLUTE/PATH.json")
    return Path(parts.path)


# --- SQLite ----------------------------------------------------------------------------------------
# one table of documents and one of generations for every namespace (the PostgreSQL store's schema too)
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS chattts_documents (namespace TEXT NOT NULL, name TEXT NOT NULL, doc TEXT NOT NULL, "
    "PRIMARY KEY (namespace, name))",
    "CREATE TABLE IF NOT EXISTS chattts_generations (namespace TEXT PRIMARY KEY, generation BIGINT NOT NULL)",
)
_GENERATION = "SELECT generation FROM chattts_generations WHERE namespace = {p}"
_SNAPSHOT = ("SELECT g.generation, d.name, d.doc FROM chattts_generations g LEFT JOIN chattts_documents d "
             "ON d.namespace = g.namespace WHERE g.namespace = {p}")


class SQLiteStore(DocumentStore):
    """An SQLite database file (WAL: readers never wait for a writer); each process keeps one connection."""

    def __init__(self, url: str, namespace: str, initial: Callable[[], Docs] = dict, max_docs: int | None = None):
        super().__init__(url, namespace, initial, max_docs)
        parts = urlsplit(url)
        if parts.netloc or not parts.path or parts.path == "/":
            raise StoreError(f"voice_store {url!r}: an SQLite store is sqlite:///ABSOLUTE/PATH (three slashes)")
        self.path = Path(parts.path)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _connect(self, create: bool) -> sqlite3.Connection | None:
        if self._conn is not None:
            return self._conn
        if not create and not self.path.exists():
            return None  # never written: nothing to read yet, and a reader creates no file
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=CONNECT_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
            conn.execute("PRAGMA busy_timeout = 5000")
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"{self.path}: {e}") from None
        self._conn = conn
        return conn

    def _read(self, sql: str):
        with self._lock:
            try:
                conn = self._connect(create=False)
                if conn is None:
                    return None
                return conn.execute(sql.format(p="?"), (self.namespace,)).fetchall()
            except sqlite3.OperationalError as e:
                if "no such table" in str(e):
                    return None  # created by the first write
                raise StoreError(f"{self.path}: {e}") from None
            except sqlite3.Error as e:
                raise StoreError(f"{self.path}: {e}") from None

    def generation(self) -> Hashable:
        rows = self._read(_GENERATION)
        return rows[0][0] if rows else None

    def snapshot(self) -> tuple[Hashable, Docs]:
        rows = self._read(_SNAPSHOT)  # one statement: one consistent read
        if not rows:
            return None, self.initial()
        return rows[0][0], {name: decode_doc(name, doc) for _, name, doc in rows if name is not None}

    def _write(self, change: Callable[[sqlite3.Connection], bool]) -> bool:
        with self._lock:
            conn = self._connect(create=True)
            try:
                conn.execute("PRAGMA journal_mode = WAL")  # readers never wait for this writer
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute("BEGIN IMMEDIATE")  # one writer at a time, across processes
                try:
                    if conn.execute(_GENERATION.format(p="?"), (self.namespace,)).fetchone() is None:
                        conn.execute("INSERT INTO chattts_generations VALUES (?, 0)", (self.namespace,))
                        conn.executemany("INSERT INTO chattts_documents VALUES (?, ?, ?)",
                                         [(self.namespace, n, d) for n, d in self._seed().items()])
                    changed = change(conn)
                    if changed:
                        conn.execute("UPDATE chattts_generations SET generation = generation + 1 WHERE namespace = ?",
                                     (self.namespace,))
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT" if changed else "ROLLBACK")  # nothing to delete: the store as it was
                return changed
            except sqlite3.Error as e:
                raise StoreError(f"{self.path}: {e}") from None

    def put(self, name: str, doc: dict, replace: bool = False) -> None:
        text = encode_doc(name, doc)

        def change(conn) -> bool:
            exists = conn.execute("SELECT 1 FROM chattts_documents WHERE namespace = ? AND name = ?",
                                  (self.namespace, name)).fetchone() is not None
            count = conn.execute("SELECT count(*) FROM chattts_documents WHERE namespace = ?",
                                 (self.namespace,)).fetchone()[0]
            check_room(name, exists, count, replace, self.limit)
            conn.execute("INSERT INTO chattts_documents VALUES (?, ?, ?) ON CONFLICT (namespace, name) "
                         "DO UPDATE SET doc = excluded.doc", (self.namespace, name, text))
            return True

        self._write(change)

    def delete(self, name: str) -> bool:
        return self._write(lambda conn: conn.execute("DELETE FROM chattts_documents WHERE namespace = ? AND name = ?",
                                                     (self.namespace, name)).rowcount > 0)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


# --- Redis -----------------------------------------------------------------------------------------
# KEYS: the documents' hash, the generation; ARGV: name, doc (empty: delete), replace, MAX_DOCS, then the initial
# documents as name, doc pairs. A store never written gets its initial documents and generation 0 before its first
# change; a refused write changes nothing. Returns the new generation, or -1 (exists), -2 (full), -3 (nothing to
# delete). A script runs alone: one transaction.
_REDIS_WRITE = """
local unseeded = redis.call('EXISTS', KEYS[2]) == 0
local exists = redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1
local count = redis.call('HLEN', KEYS[1])
if unseeded then
  count = (#ARGV - 4) / 2
  for i = 5, #ARGV, 2 do if ARGV[i] == ARGV[1] then exists = true end end
end
if ARGV[2] == '' and not exists then return -3 end
if ARGV[2] ~= '' and exists and ARGV[3] == '0' then return -1 end
if ARGV[2] ~= '' and (not exists) and count >= tonumber(ARGV[4]) then return -2 end
if unseeded then
  for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
  redis.call('SET', KEYS[2], 0)
end
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return redis.call('INCR', KEYS[2])
"""


class RedisStore(DocumentStore):
    """A Redis hash of the documents and a counter, under one hash tag (`{prefix}`: one slot of a cluster)."""

    poll_s = POLL_S

    def __init__(self, url: str, namespace: str, initial: Callable[[], Docs] = dict, max_docs: int | None = None):
        super().__init__(url, namespace, initial, max_docs)
        try:
            import redis
        except ImportError:
            raise StoreError("a redis:// voice store needs the redis package: pip install redis") from None
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        prefix = query.pop("prefix", ["chattts"])[0]
        base = urlunsplit(parts._replace(query="&".join(f"{k}={v[0]}" for k, v in query.items())))
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._redis_error = redis.RedisError
        try:
            self.client = redis.Redis.from_url(base, socket_timeout=CONNECT_TIMEOUT_S,
                                               socket_connect_timeout=CONNECT_TIMEOUT_S, decode_responses=True)
        except ValueError as e:
            raise StoreError(f"voice_store {shown_url(url)!r}: {e}") from None
        tag = "{" + f"{prefix}:{namespace}" + "}"
        self.keys = (f"{tag}:documents", f"{tag}:generation")
        self._write_script = self.client.register_script(_REDIS_WRITE)

    def _call(self, fn):
        try:
            return fn()
        except self._errors as e:
            raise StoreUnavailable(f"{shown_url(self.url)}: {e}") from None
        except self._redis_error as e:
            raise StoreError(f"{shown_url(self.url)}: {e}") from None

    def generation(self) -> Hashable:
        return self._call(lambda: self.client.get(self.keys[1]))

    def snapshot(self) -> tuple[Hashable, Docs]:
        def read():
            with self.client.pipeline(transaction=True) as p:  # MULTI/EXEC: one consistent read
                return p.get(self.keys[1]).hgetall(self.keys[0]).execute()

        generation, docs = self._call(read)
        if generation is None:
            return None, self.initial()
        return generation, {name: decode_doc(name, doc) for name, doc in docs.items()}

    def _write(self, name: str, text: str, replace: bool) -> int:
        seed = [x for pair in self._seed().items() for x in pair]
        return int(self._call(lambda: self._write_script(keys=list(self.keys),
                                                          args=[name, text, int(replace), self.limit, *seed])))

    def put(self, name: str, doc: dict, replace: bool = False) -> None:
        result = self._write(name, encode_doc(name, doc), replace)
        if result == -1:
            raise Exists(f"{name!r} exists")
        if result == -2:
            raise Full(f"the store holds {self.limit} entries, the most it may")

    def delete(self, name: str) -> bool:
        return self._write(name, "", False) != -3

    def close(self) -> None:
        self.client.close()


# --- PostgreSQL ------------------------------------------------------------------------------------
class PostgresStore(DocumentStore):
    """Two tables (the SQLite store's schema), created by the first write; a reader needs SELECT only. Writers
    serialise on the namespace's generation row (SELECT ... FOR UPDATE)."""

    poll_s = POLL_S

    def __init__(self, url: str, namespace: str, initial: Callable[[], Docs] = dict, max_docs: int | None = None):
        super().__init__(url, namespace, initial, max_docs)
        try:
            import psycopg
        except ImportError:
            raise StoreError("a postgresql:// voice store needs psycopg 3: pip install 'psycopg[binary]'") from None
        self._psycopg = psycopg
        self._conn = None
        self._lock = threading.Lock()

    def _connection(self):
        if self._conn is None or self._conn.closed:
            try:
                self._conn = self._psycopg.connect(self.url, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT_S))
            except self._psycopg.OperationalError as e:
                raise StoreUnavailable(f"{shown_url(self.url)}: {str(e).strip()}") from None
            except self._psycopg.Error as e:
                raise StoreError(f"{shown_url(self.url)}: {str(e).strip()}") from None
        return self._conn

    def _run(self, fn):
        psycopg = self._psycopg
        with self._lock:
            conn = self._connection()
            try:
                return fn(conn)
            except psycopg.errors.UndefinedTable:
                return None  # created by the first write
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                conn.close()  # the next call connects again
                raise StoreUnavailable(f"{shown_url(self.url)}: {str(e).strip()}") from None
            except psycopg.Error as e:
                raise StoreError(f"{shown_url(self.url)}: {str(e).strip()}") from None

    def generation(self) -> Hashable:
        row = self._run(lambda c: c.execute(_GENERATION.format(p="%s"), (self.namespace,)).fetchone())
        return row[0] if row else None

    def snapshot(self) -> tuple[Hashable, Docs]:
        rows = self._run(lambda c: c.execute(_SNAPSHOT.format(p="%s"), (self.namespace,)).fetchall())
        if not rows:
            return None, self.initial()
        return rows[0][0], {name: decode_doc(name, doc) for _, name, doc in rows if name is not None}

    def _write(self, change) -> bool:
        psycopg = self._psycopg

        def run(conn) -> bool:
            for attempt in range(2):
                try:
                    for statement in _SCHEMA:
                        conn.execute(statement)
                    break
                except psycopg.errors.UniqueViolation:  # two first writers created the tables at once
                    if attempt:
                        raise
            with conn.transaction():
                conn.execute("INSERT INTO chattts_generations VALUES (%s, 0) ON CONFLICT DO NOTHING", (self.namespace,))
                conn.execute(_GENERATION.format(p="%s") + " FOR UPDATE", (self.namespace,))
                count = conn.execute("SELECT count(*) FROM chattts_documents WHERE namespace = %s",
                                     (self.namespace,)).fetchone()[0]
                generation = conn.execute(_GENERATION.format(p="%s"), (self.namespace,)).fetchone()[0]
                if generation == 0 and count == 0:  # never written: the initial documents first
                    with conn.cursor() as cur:
                        cur.executemany("INSERT INTO chattts_documents VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                                        [(self.namespace, n, d) for n, d in self._seed().items()])
                changed = change(conn)
                if not changed:  # nothing to delete: the store as it was
                    raise psycopg.Rollback()
                conn.execute("UPDATE chattts_generations SET generation = generation + 1 WHERE namespace = %s",
                             (self.namespace,))
            return changed

        result = self._run(run)
        if result is None:
            raise StoreError(f"{shown_url(self.url)}: the tables could not be created")
        return result

    def put(self, name: str, doc: dict, replace: bool = False) -> None:
        text = encode_doc(name, doc)

        def change(conn) -> bool:
            exists = conn.execute("SELECT 1 FROM chattts_documents WHERE namespace = %s AND name = %s",
                                  (self.namespace, name)).fetchone() is not None
            count = conn.execute("SELECT count(*) FROM chattts_documents WHERE namespace = %s",
                                 (self.namespace,)).fetchone()[0]
            check_room(name, exists, count, replace, self.limit)
            conn.execute("INSERT INTO chattts_documents VALUES (%s, %s, %s) ON CONFLICT (namespace, name) "
                         "DO UPDATE SET doc = excluded.doc", (self.namespace, name, text))
            return True

        self._write(change)

    def delete(self, name: str) -> bool:
        return self._write(lambda conn: conn.execute("DELETE FROM chattts_documents WHERE namespace = %s AND name = %s",
                                                     (self.namespace, name)).rowcount > 0)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def open_server_store(url: str, namespace: str, initial: Callable[[], Docs] = dict,
                      max_docs: int | None = None) -> DocumentStore:
    """The store a sqlite:, redis: or postgresql: URL names (file: and the default are the caller's)."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "sqlite":
        return SQLiteStore(url, namespace, initial, max_docs)
    if scheme in ("redis", "rediss"):
        return RedisStore(url, namespace, initial, max_docs)
    if scheme in ("postgresql", "postgres"):
        return PostgresStore(url, namespace, initial, max_docs)
    raise StoreError(f"voice_store {shown_url(url)!r}: the scheme must be one of {', '.join(s + ':' for s in SCHEMES)} "
                     f"(or empty: the repository's voices.json)")


def env_or(value: str, env: str) -> str:
    """A store URL: the environment variable `env` where it is set (a URL with a password stays out of configs),
    else `value`."""
    return os.environ.get(env, "").strip() or (value or "").strip()


# --- following a store -----------------------------------------------------------------------------
_UNREAD = object()


class Follower:
    """What `build` makes of a store's documents, made again when the store's generation changes: the generation is
    asked for at most every `store.poll_s` seconds (every time for a file or an SQLite database), the documents read
    only when it changed. `current()` is (generation, what was built).

    While the store's server cannot be reached, what was built last stays in use (logged). Where nothing was read yet,
    or the store holds something `build` or the store's own reading refuses (a StoreError), `keep_last` decides:
    False (the voices) fails the caller with the error, True (the lexicon, which every request passes through) logs it
    and goes on with what was built last, `empty` at first, asking again after the poll interval."""

    def __init__(self, store: DocumentStore, build: Callable[[Docs], Any], what: str, keep_last: bool = False,
                 empty: Any = None):
        self.store, self.build, self.what, self.keep_last = store, build, what, keep_last
        self._lock = threading.Lock()
        self._key: Hashable = _UNREAD
        self._polled = -float("inf")
        self._value: Any = empty
        self._error: StoreError | None = None

    def current(self) -> tuple[Hashable, Any]:
        now = time.monotonic()
        with self._lock:
            if now - self._polled < self.store.poll_s:
                return self._current()
        key: Hashable = _UNREAD
        try:
            key = self.store.generation()
            with self._lock:
                changed = key != self._key
            if changed:
                key, docs = self.store.snapshot()
                value = self.build(docs)
                with self._lock:
                    self._value, self._error, self._key = value, None, key
        except StoreUnavailable as e:
            with self._lock:
                if not self.keep_last and (self._key is _UNREAD or self._error is not None):
                    raise
                log.warning("%s: the store is unavailable, still using what was read last: %s", self.what, e)
                self._polled = now
                return self._current()
        except StoreError as e:
            with self._lock:
                if self.keep_last:
                    log.error("%s: %s; still using the last good one (%s)", self.what, e, _size(self._value))
                    self._key, self._polled = key, now
                    return self._current()
                log.error("%s: %s", self.what, e)
                self._error, self._key = e, key  # fails every call until the store changes
            raise
        with self._lock:
            self._polled = now
            return self._current()

    def _current(self) -> tuple[Hashable, Any]:
        if self._error is not None:
            raise self._error
        return self._key, self._value


def _size(value: Any) -> str:
    try:
        return f"{len(value)} entries"
    except TypeError:
        return "as read last"
