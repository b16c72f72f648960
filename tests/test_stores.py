"""The voice stores (chattts_triton/runtime/stores.py and voices.py's FileVoiceStore) against real back-ends: a
voices.json, an SQLite file, a redis-server and a PostgreSQL server started by this run (tests/conftest.py). Each
store is opened twice, as two processes would: a write through one is what the other reads next; a refused write
changes nothing; a reader never sees a document half-written; the registry over a store resolves what it holds and
keeps the voices read last while a server is down."""

from __future__ import annotations

import json
import threading

import pytest

from chattts_triton.config import BUILTIN_VOICE_SEEDS, VOICES
from chattts_triton.model import speaker as spk
from chattts_triton.model.text import InputError
from chattts_triton.runtime import stores as S
from chattts_triton.runtime import voices as V

HIDDEN = 64  # the tiny model's speakers


def _url(kind: str, tmp_path, request) -> str:
    if kind == "file":
        return f"file://{tmp_path}/voices.json"
    if kind == "sqlite":
        return f"sqlite://{tmp_path}/voices.db"
    url = request.getfixturevalue("redis_url" if kind == "redis" else "postgres_url")
    if kind == "redis":  # each test its own keys
        return f"{url}?prefix=t{abs(hash(request.node.name))}"
    return url


@pytest.fixture(params=["file", "sqlite", "redis", "postgresql"])
def pair(request, tmp_path):
    """Two stores of one URL (two processes' views of it), each test on a namespace of its own."""
    url = _url(request.param, tmp_path, request)
    namespace = f"voices_{abs(hash(request.node.name))}"
    if request.param == "file":
        stores = [V.open_voice_store(url), V.open_voice_store(url)]
    else:
        stores = [S.open_server_store(url, namespace, V.initial_docs) for _ in range(2)]
    yield stores
    for s in stores:
        s.close()


def test_a_store_never_written_serves_the_builtins_and_a_write_keeps_them(pair):
    a, b = pair
    assert a.generation() is None and b.snapshot() == (None, V.initial_docs())
    with pytest.raises(S.Exists):  # the built-ins are there before the first write
        a.put("alloy", {"seed": 1})
    assert V.delete_voice(a, "nope") is False and b.generation() is None  # a refused write writes nothing
    a.put("narrator", {"seed": 42})
    generation, docs = b.snapshot()
    assert generation is not None and generation == b.generation() == a.generation()
    assert docs == {**V.initial_docs(), "narrator": {"seed": 42}}


def test_every_write_raises_the_generation_and_a_refused_one_changes_nothing(pair, monkeypatch):
    a, b = pair
    a.put("one", {"seed": 1})
    before = b.snapshot()
    with pytest.raises(S.Exists):
        b.put("one", {"seed": 2})
    with pytest.raises(S.StoreError, match="more than the limit"):
        b.put("big", {"description": "x" * S.MAX_DOC_BYTES})
    monkeypatch.setattr(S, "MAX_DOCS", len(before[1]))
    with pytest.raises(S.Full):
        b.put("two", {"seed": 2})
    assert a.snapshot() == before and a.generation() == before[0]
    b.put("one", {"seed": 3}, replace=True)  # a full store still takes a replacement
    assert a.generation() != before[0] and a.get("one") == {"seed": 3}
    after = a.generation()
    assert V.delete_voice(b, "nope") is False and a.generation() == after
    assert V.delete_voice(b, "one") is True and a.get("one") is None and a.generation() != after
    V.delete_voice(a, "alloy")  # a built-in goes like any other voice, and stays gone
    assert "alloy" not in b.snapshot()[1] and "nova" in b.snapshot()[1]


def test_a_reader_sees_the_old_document_or_the_new_never_half_of_one(pair):
    a, b = pair
    old, new = {"description": "o" * 8000, "seed": 1}, {"description": "n" * 9000, "seed": 2}
    a.put("v", old)
    seen, errors = set(), []

    def read():
        try:
            for _ in range(150):
                doc = b.snapshot()[1]["v"]
                seen.add(doc["seed"])
                assert doc in (old, new)
        except BaseException as e:  # noqa: BLE001  reported by the test's thread
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(60):
        a.put("v", new if i % 2 == 0 else old, replace=True)
    reader.join()
    assert not errors, errors
    assert seen <= {1, 2}


def test_the_registry_over_a_store_resolves_a_write_of_another_process_at_its_next_look(pair):
    a, b = pair
    b.poll_s = 0  # the rule under test is the generation, not the poll interval
    reg = V.VoiceRegistry(b, HIDDEN)
    assert reg.resolve("alloy").speaker == spk.sample_random_speaker(BUILTIN_VOICE_SEEDS["alloy"], HIDDEN)
    with pytest.raises(InputError, match="'narrator' is not a voice"):
        reg.resolve("narrator")
    a.put("narrator", {"seed": 42, "description": "deep"})
    voice = reg.resolve("narrator")
    assert voice.speaker == spk.sample_random_speaker(42, HIDDEN) and voice.seed == 42 and voice.description == "deep"
    mixed = reg.resolve("narrator*0.5+alloy*0.5")
    a.put("narrator", {"seed": 7}, replace=True)
    assert reg.resolve("narrator").seed == 7 and reg.resolve("narrator*0.5+alloy*0.5").speaker != mixed.speaker
    V.delete_voice(a, "narrator")
    with pytest.raises(InputError, match="'narrator' is not a voice"):
        reg.resolve("narrator")


def test_a_server_store_is_asked_for_its_generation_at_most_every_poll_interval(redis_url, monkeypatch):
    store = S.open_server_store(redis_url + "?prefix=poll", "voices", V.initial_docs)
    calls = []
    generation = store.generation
    monkeypatch.setattr(store, "generation", lambda: calls.append(1) or generation())
    clock = [100.0]
    monkeypatch.setattr(S.time, "monotonic", lambda: clock[0])
    reg = V.VoiceRegistry(store, HIDDEN)
    for _ in range(5):
        reg.resolve("alloy")
    assert len(calls) == 1
    clock[0] += S.POLL_S
    reg.resolve("alloy")
    assert len(calls) == 2 and store.poll_s == S.POLL_S


def test_a_server_down_keeps_the_voices_read_last_and_a_first_read_fails_naming_it(redis_url):
    from chattts_triton.launcher.tritonserver import free_port

    store = S.open_server_store(redis_url + "?prefix=down", "voices", V.initial_docs)
    store.poll_s = 0
    reg = V.VoiceRegistry(store, HIDDEN)
    store.put("kept", {"seed": 5})
    assert reg.resolve("kept").seed == 5
    import redis

    store.client = redis.Redis(port=free_port(), socket_connect_timeout=1)  # the server gone
    with pytest.raises(S.StoreUnavailable):
        store.generation()  # what the registry asks first: it fails now
    assert reg.resolve("kept").seed == 5
    dead = S.open_server_store(f"redis://127.0.0.1:{free_port()}/0", "voices", V.initial_docs)
    with pytest.raises(S.StoreUnavailable, match=r"127\.0\.0\.1"):
        V.VoiceRegistry(dead, HIDDEN).resolve("alloy")


def test_the_file_store_is_the_repository_registry_the_cli_and_export_write(tmp_path):
    store = V.open_voice_store("", tmp_path)
    assert isinstance(store, V.FileVoiceStore) and store.path == tmp_path / VOICES
    store.put("narrator", {"seed": 42})
    assert json.loads((tmp_path / VOICES).read_text())["format"] == V.FORMAT
    assert V.read_voices(tmp_path / VOICES)["narrator"].seed == 42
    with V.editing(tmp_path, HIDDEN) as voices:
        voices["other"] = V.seed_voice("other", 3, HIDDEN)
    assert store.get("other")["seed"] == 3 and store.get("narrator") == {"seed": 42}


def test_store_urls(tmp_path, monkeypatch):
    assert S.shown_url("redis://:secret@host:6379/0") == "redis://:***@host:6379/0"
    assert S.shown_url("postgresql://u:pw@h/db") == "postgresql://u:***@h/db"
    assert S.shown_url("sqlite:///x.db") == "sqlite:///x.db"
    for bad, words in [("mysql://h/db", "scheme must be one of"), ("sqlite://relative.db", "three slashes"),
                       ("file:///tmp/voices.txt", "file:///ABSOLUTE/PATH.json")]:
        with pytest.raises(S.StoreError, match=words):
            V.open_voice_store(bad)
    with pytest.raises(S.StoreError, match="no voice store"):
        V.open_voice_store("")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "manifest.json").write_text(json.dumps({"deployment": {"voice_store": "sqlite:///from/manifest.db"}}))
    monkeypatch.delenv("CHATTTS_VOICE_STORE", raising=False)
    assert V.store_url(repo) == "sqlite:///from/manifest.db" and V.store_url(repo, "redis://given") == "redis://given"
    monkeypatch.setenv("CHATTTS_VOICE_STORE", "redis://env")
    assert V.store_url(repo) == "redis://env" and V.store_url(tmp_path / "none") == "redis://env"


# --- the pronunciation lexicon: a second namespace of the same store ------------------------------------------------
@pytest.fixture(params=["file", "sqlite", "redis", "postgresql"])
def lexicon_pair(request, tmp_path):
    """Two views of one store's lexicon (two processes opening the voice_store URL), and a view of its voices."""
    from chattts_triton.runtime import lexicon as L

    url = _url(request.param, tmp_path, request)
    views = [L.open_lexicon_store(url) for _ in range(2)]
    voices = V.open_voice_store(url)
    yield views, voices
    for s in (*views, voices):
        s.close()


def test_the_lexicon_is_a_namespace_of_the_voice_store_one_views_write_is_what_the_other_applies(lexicon_pair):
    from chattts_triton.model.lexicon import MAX_ENTRIES, check_entry
    from chattts_triton.runtime import lexicon as L

    (a, b), voices = lexicon_pair
    b.poll_s = 0  # the rule under test is the generation, not the poll interval
    registry = L.LexiconRegistry(b)
    assert a.limit == MAX_ENTRIES and registry.apply("我在重庆用AWS") == "我在重庆用AWS"  # never written: no lexicon
    voices_before = voices.snapshot()
    assert L.put_entry(a, check_entry("重庆", "虫庆")) is False
    assert L.put_entry(a, check_entry("aws", "A W S", True)) is False
    assert registry.apply("我在重庆用AWS") == "我在虫庆用A W S"
    assert voices.snapshot() == voices_before  # the voices' namespace is not touched (nor the lexicon's by a voice)
    generation = b.generation()
    with pytest.raises(L.EntryConflict, match="'AWS'.*'aws' ignores case"):  # refused: nothing written
        L.put_entry(b, check_entry("AWS", "a w s", True))
    with pytest.raises(S.Exists):
        L.put_entry(b, check_entry("重庆", "重亲"))
    assert a.generation() == generation and registry.apply("AWS") == "A W S"
    assert L.put_entry(b, check_entry("重庆", "虫亲"), replace=True) is True
    assert registry.apply("重庆") == "虫亲" and a.get("重庆") == {"say": "虫亲"}
    assert b.delete("重庆") is True and b.delete("重庆") is False and registry.apply("重庆") == "重庆"
    assert L.lexicon_of(a.snapshot()[1])[0].apply("Aws") == "A W S"


def test_a_lexicon_entry_the_store_holds_but_cannot_use_is_left_out_and_logged(tmp_path, caplog):
    from chattts_triton.runtime import lexicon as L

    store = L.open_lexicon_store(f"sqlite://{tmp_path}/voices.db")
    store.put("ok", {"say": "fine"})
    store.put("bad word", {"say": "x"})  # a writer that did not check it (the CLI and HTTP refuse it)
    store.put("Nginx", {"say": "engine x", "ignore_case": True})
    store.put("nginx", {"say": "n g", "ignore_case": True})  # two writers at once: one spelling twice
    lexicon, broken = L.lexicon_of(store.snapshot()[1])
    assert [e.word for e in lexicon.entries()] == ["Nginx", "ok"] and set(broken) == {"bad word", "nginx"}
    assert L.LexiconRegistry(store).apply("ok NGINX") == "fine engine x" and "entries left out" in caplog.text


def test_a_store_server_down_keeps_the_lexicon_read_last_and_never_fails_a_request(redis_url, caplog):
    from chattts_triton.launcher.tritonserver import free_port
    from chattts_triton.model.lexicon import check_entry
    from chattts_triton.runtime import lexicon as L

    store = L.open_lexicon_store(redis_url + "?prefix=lexdown")
    store.poll_s = 0
    registry = L.LexiconRegistry(store)
    L.put_entry(store, check_entry("重庆", "虫庆"))
    assert registry.apply("重庆") == "虫庆"
    import redis

    store.client = redis.Redis(port=free_port(), socket_connect_timeout=1)  # the server gone
    with pytest.raises(S.StoreUnavailable):
        store.generation()
    assert registry.apply("重庆") == "虫庆" and "the store is unavailable" in caplog.text
    dead = L.open_lexicon_store(f"redis://127.0.0.1:{free_port()}/0")  # never read: no lexicon, said in the log
    assert L.LexiconRegistry(dead).apply("重庆") == "重庆"


def test_lexicon_store_urls(tmp_path):
    from chattts_triton.config import LEXICON
    from chattts_triton.runtime import lexicon as L

    assert L.open_lexicon_store("", tmp_path).path == tmp_path / LEXICON  # the default: the repository's file
    assert L.open_lexicon_store(f"file://{tmp_path}/shared/voices.json").path == tmp_path / "shared" / LEXICON
    with pytest.raises(S.StoreError, match="beside the voices' file"):
        L.open_lexicon_store(f"file://{tmp_path}/lexicon.json")
    with pytest.raises(S.StoreError, match="no lexicon"):
        L.open_lexicon_store("")
    store = L.open_lexicon_store(f"sqlite://{tmp_path}/v.db")
    assert (store.namespace, store.limit) == (L.NAMESPACE, 20_000)
