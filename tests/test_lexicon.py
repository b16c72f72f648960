"""The pronunciation lexicon: matching (chattts_triton.model.lexicon: exact, case rules, word edges, longest first,
control tokens untouched) with Chinese polyphones and English brand names, the repository file and its registry
(edits seen without a restart, a broken file keeps the last good one), the command line (a shared voice store's lexicon
with --voice-store, import), preprocess (before normalisation, visible in SPOKEN_TEXT; a store's lexicon followed), a
re-export keeping it, and the real tiny server. The store-backed lexicon against every back-end: tests/test_stores.py;
over HTTP: tests/test_voices_http.py; shared by two gateways and a tritonserver: tests/test_voices_http_e2e.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from chattts_triton.config import LEXICON, TINY_ARCH
from chattts_triton.model.lexicon import (
    MAX_SAY_CHARS,
    MAX_WORD_CHARS,
    Entry,
    Lexicon,
    LexiconError,
    check_entry,
    from_json,
)
from chattts_triton.runtime import lexicon as L

ROOT = Path(__file__).resolve().parents[1]

POLYPHONES = {"重庆": "虫庆", "银行": "银航", "行长": "航长", "长大": "涨大", "音乐": "音月", "银行行长": "银航航长"}
BRANDS = {"AWS": ("A W S", False), "nginx": ("engine x", True), "Huawei": ("wah way", False),
          "iPhone": ("eye phone", False), "SQL": ("sequel", False), "Xiaomi": ("shao mee", True)}


def lexicon(**extra) -> Lexicon:
    entries = [check_entry(w, s) for w, s in POLYPHONES.items()]
    entries += [check_entry(w, s, ignore) for w, (s, ignore) in BRANDS.items()]
    return Lexicon(entries + [check_entry(w, s, i) for w, (s, i) in extra.items()])


# --- matching ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("我在重庆的银行工作。", "我在虫庆的银航工作。"),
    ("重庆市长大了", "虫庆市涨大了"),  # Chinese words match inside longer ones: no spaces tell words apart
    ("银行行长说音乐好听", "银航航长说音月好听"),  # the longest match first: 银行行长, not 银行 then 行长
    ("行长去银行", "航长去银航"),
    ("Deploy nginx on AWS.", "Deploy engine x on A W S."),
    ("NGINX, Nginx and nginx", "engine x, engine x and engine x"),  # ignore_case: any case of A-Z
    ("aws, Aws and AWS", "aws, Aws and A W S"),  # exact: only as written
    ("LAWS and AWSome and SQLite", "LAWS and AWSome and SQLite"),  # never inside a Latin word
    ("AWS-CLI, (AWS) AWS/SQL", "A W S-CLI, (A W S) A W S/sequel"),  # punctuation is an edge
    ("iPhone15 vs iPhone 15", "iPhone15 vs eye phone 15"),  # a digit continues a word
    ("买小米Xiaomi和华为Huawei手机", "买小米shao mee和华为wah way手机"),  # Chinese characters are an edge
])
def test_polyphones_and_brand_names(text, expected):
    assert lexicon().apply(text) == expected


def test_control_tokens_are_never_matched_into_and_replacements_may_hold_them():
    lex = lexicon(**{"break": ("brake", True), "uv": ("you vee", False), "OK": ("okay [uv_break]", False)})
    assert (lex.apply("[uv_break] break BREAK[uv_break]uv OK")
            == "[uv_break] brake brake[uv_break]you vee okay [uv_break]")


def test_an_exact_entry_wins_over_an_ignore_case_one_of_the_same_letters():
    lex = Lexicon([check_entry("Apple", "the company"), check_entry("apple", "the fruit", True)])
    assert lex.apply("Apple apple APPLE") == "the company the fruit the fruit"
    assert [(m[0], m[1], m[2].word) for m in lex.matches("an Apple")] == [(3, 8, "Apple")]


def test_an_empty_lexicon_leaves_text_alone():
    assert Lexicon().apply("重庆 AWS") == "重庆 AWS" and Lexicon().matches("x") == []


def test_matching_is_linear_in_the_text_whatever_the_number_of_entries():
    many = Lexicon([check_entry(f"word{i}", f"say{i}") for i in range(20000)])
    text = " ".join(f"word{i}" for i in range(0, 20000, 97)) * 3
    t0 = time.perf_counter()
    out = many.apply(text[:2000])
    assert time.perf_counter() - t0 < 1.0 and "say0 say97" in out and "word97 " not in out


@pytest.mark.parametrize("word, say, words", [
    ("", "x", "1-64 characters"), ("x" * (MAX_WORD_CHARS + 1), "x", "1-64 characters"),
    ("two words", "x", "holds ' '"), ("[uv_break]", "x", "holds '['"), ("a\tb", "x", "holds '\\t'"),
    ("ok", "", "is empty"), ("ok", "x" * (MAX_SAY_CHARS + 1), "more than the limit of 256"),
    ("ok", "[bad_token]", "unknown token"), ("ok", "a\x00b", "control character"), ("ok", 5, "must be a string"),
])
def test_bad_entries_are_refused_naming_them(word, say, words):
    with pytest.raises(LexiconError) as e:
        check_entry(word, say)
    assert words in str(e.value)


def test_a_word_given_twice_is_refused():
    with pytest.raises(LexiconError, match="'NGINX' is given twice .as 'nginx', both ignoring case."):
        Lexicon([check_entry("nginx", "a", True), check_entry("NGINX", "b", True)])


@pytest.mark.parametrize("doc, words", [
    ([], "a lexicon is"), ({"format": 2, "entries": {}}, "a lexicon is"),
    ({"format": 1, "entries": []}, "a lexicon is"),
    ({"format": 1, "entries": {"x": "y"}}, "an entry is"),
    ({"format": 1, "entries": {"x": {"say": "y", "z": 1}}}, "an entry is"),
    ({"format": 1, "entries": {"x": {"say": "y", "ignore_case": "yes"}}}, "ignore_case must be true or false"),
])
def test_bad_documents_are_refused(doc, words):
    with pytest.raises(LexiconError, match=words):
        from_json(doc)


# --- the file, the registry ----------------------------------------------------------------------------------
@pytest.fixture
def repo(tmp_path) -> Path:
    (tmp_path / "repo").mkdir()
    return tmp_path / "repo"


def test_file_round_trip_and_registry_follows_edits_without_a_restart(repo, caplog):
    reg = L.LexiconRegistry(repo)
    assert reg.apply("重庆") == "重庆"  # no file: no lexicon
    with L.editing(repo) as entries:
        entries["重庆"] = check_entry("重庆", "虫庆")
    assert reg.apply("重庆") == "虫庆"
    doc = json.loads((repo / LEXICON).read_text(encoding="utf-8"))
    assert doc == {"format": 1, "entries": {"重庆": {"say": "虫庆"}}}
    with L.editing(repo) as entries:
        entries["AWS"] = check_entry("AWS", "A W S", True)
    assert (reg.apply("重庆 aws") == "虫庆 A W S"
            and L.read_lexicon(repo / LEXICON).entries()[0] == Entry("AWS", "A W S", True))
    (repo / LEXICON).write_text("{broken", encoding="utf-8")  # a hand edit gone wrong: the last good one stays
    assert (reg.apply("重庆 aws") == "虫庆 A W S" and "cannot be read" in caplog.text
            and "last good one (2 entries)" in caplog.text)
    (repo / LEXICON).unlink()
    assert reg.apply("重庆") == "重庆"


def test_an_edit_that_fails_writes_nothing(repo):
    with L.editing(repo) as entries:
        entries["a"] = check_entry("a", "b")
    before = (repo / LEXICON).read_bytes()
    with pytest.raises(RuntimeError):
        with L.editing(repo) as entries:
            entries["c"] = check_entry("c", "d")
            raise RuntimeError("stop")
    assert (repo / LEXICON).read_bytes() == before and not [p for p in repo.iterdir() if p.name.startswith(".")]


# --- command line -----------------------------------------------------------------------------------
def cli(capsys, repo: Path, *args: str):
    """(exit status, stdout, stderr) of `python -m chattts_triton.lexicon --repo REPO ARGS`, in this process."""
    capsys.readouterr()
    try:
        code = L.main(["--repo", str(repo), *args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_adds_lists_applies_and_removes_entries(repo, capsys):
    assert cli(capsys, repo, "add", "重庆", "虫庆")[0] == 0
    assert cli(capsys, repo, "add", "nginx", "engine x", "--ignore-case")[0] == 0
    assert cli(capsys, repo, "list")[1] == "nginx\tengine x\t(any case)\n重庆\t虫庆\n"
    assert json.loads(cli(capsys, repo, "list",
                          "--json")[1]) == json.loads((repo / LEXICON).read_text(encoding="utf-8"))
    assert cli(capsys, repo, "apply", "重庆的NGINX")[1] == "虫庆的engine x\n"
    code, _, err = cli(capsys, repo, "add", "重庆", "重亲")
    assert code == 1 and "--force" in err
    assert (cli(capsys, repo, "add", "重庆", "虫亲", "--force")[0] == 0
            and cli(capsys, repo, "apply", "重庆")[1] == "虫亲\n")
    code, _, err = cli(capsys, repo, "add", "two words", "x")
    assert code == 1 and "holds ' '" in err
    assert cli(capsys, repo, "remove", "重庆")[0] == 0
    code, _, err = cli(capsys, repo, "remove", "重庆")
    assert code == 1 and "no entry '重庆'" in err
    assert cli(capsys, repo.parent / "nowhere", "list")[0] == 1
    assert cli(capsys, repo, "add", "x")[0] == 2  # argparse: SAY is missing


def test_cli_runs_as_a_module(repo):
    run = subprocess.run([sys.executable, "-m", "chattts_triton.lexicon", "--repo", str(repo), "add", "AWS", "A W S"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (run.returncode == 0 and run.stdout == "added AWS -> A W S\n"
            and L.read_lexicon(repo / LEXICON).apply("AWS") == "A W S")


def test_cli_edits_a_shared_stores_lexicon_with_voice_store_and_imports_a_file(repo, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("CHATTTS_VOICE_STORE", raising=False)
    url = f"sqlite://{tmp_path}/voices.db"
    assert cli(capsys, repo, "add", "AWS", "A W S")[0] == 0  # the repository's file, as before
    assert cli(capsys, repo, "--voice-store", url, "add", "重庆", "虫庆")[0] == 0
    assert cli(capsys, repo, "--voice-store", url, "list")[1] == "重庆\t虫庆\n"  # the store's, not the file's
    assert L.read_lexicon(repo / LEXICON).apply("重庆 AWS") == "重庆 A W S"
    code, out, _ = cli(capsys, repo, "--voice-store", url, "import", str(repo / LEXICON))
    assert code == 0 and out == f"imported 1 entries from {repo / LEXICON}\n"
    assert cli(capsys, repo, "--voice-store", url, "apply", "重庆 AWS")[1] == "虫庆 A W S\n"
    code, _, err = cli(capsys, repo, "--voice-store", url, "import", str(repo / LEXICON))
    assert code == 1 and "--force" in err
    assert cli(capsys, repo, "--voice-store", url, "add", "aws", "x", "--ignore-case")[0] == 0
    code, _, err = cli(capsys, repo, "--voice-store", url, "add", "AWs", "y", "--ignore-case")
    assert code == 1 and "'aws' ignores case" in err
    monkeypatch.setenv("CHATTTS_VOICE_STORE", url)  # the store of the environment, without --repo
    assert L.main(["remove", "重庆"]) == 0 and capsys.readouterr().out == "removed 重庆\n"
    assert L.LexiconRegistry(L.open_lexicon_store(url)).apply("重庆 AWS") == "重庆 A W S"
    monkeypatch.delenv("CHATTTS_VOICE_STORE")
    with pytest.raises(SystemExit):  # neither a repository nor a store
        L.main(["list"])
    assert "--voice-store" in capsys.readouterr().err


# --- preprocess -------------------------------------------------------------------------------------------
@pytest.fixture
def pre(tiny_assets, repo):
    from chattts_triton.runtime.preprocess import PreprocessService

    version = repo / "chattts_preprocess" / "1"
    version.mkdir(parents=True)
    (version / "tokenizer").symlink_to(Path(tiny_assets) / "tokenizer", target_is_directory=True)
    service = PreprocessService(version, TINY_ARCH, torch.device("cpu"), "torchscript")
    yield service
    service.close()


def b(s: str) -> np.ndarray:
    return np.array([[s.encode()]], dtype=object)


def spoken(out) -> str:
    return out["SPOKEN_TEXT"][0, 0].decode("utf-8")


def test_preprocess_applies_the_lexicon_before_normalisation_and_shows_it_in_spoken_text(pre, repo):
    plain = spoken(pre.prepare({"TEXT": b("票价12306元，去重庆。")}))
    with L.editing(repo) as entries:
        for word, say in {"重庆": "虫庆", "12306": "幺二三零六", "AWS": "A W S"}.items():
            entries[word] = check_entry(word, say)
    out = spoken(pre.prepare({"TEXT": b("票价12306元，去重庆。")}))
    # before normalisation: the entry's words, not the normaliser's reading of the number
    assert out == pre.normalize("票价幺二三零六元，去虫庆。") and "一万" in plain and "重庆" in plain
    assert spoken(pre.prepare({"TEXT": b("Deploy on AWS.")})) == "Deploy on A W S."
    # NORMALIZE_TEXT off: the text is read exactly as sent
    assert spoken(pre.prepare({"TEXT": b("去重庆"), "NORMALIZE_TEXT": np.array([[False]])})) == "去重庆"
    # SSML first (a sub alias is what the lexicon sees), then the lexicon
    document = '<speak><sub alias="AWS">amazon web services</sub> in 重庆</speak>'
    assert spoken(pre.prepare({"TEXT": b(document)})) == pre.normalize("A W S in 虫庆")


def test_preprocess_reads_the_lexicon_of_its_voice_store_and_follows_its_writes(tiny_assets, repo, tmp_path,
                                                                                 monkeypatch):
    """chattts_preprocess (and chattts_stream, the same service) over an SQLite store: a write of another process (a
    gateway, the CLI) is in SPOKEN_TEXT at the next request; the repository's lexicon.json is not read."""
    from chattts_triton.runtime.preprocess import PreprocessService

    monkeypatch.delenv("CHATTTS_VOICE_STORE", raising=False)
    url = f"sqlite://{tmp_path}/voices.db"
    version = repo / "chattts_preprocess" / "1"
    version.mkdir(parents=True)
    (version / "tokenizer").symlink_to(Path(tiny_assets) / "tokenizer", target_is_directory=True)
    with L.editing(repo) as entries:
        entries["AWS"] = check_entry("AWS", "A W S")
    service = PreprocessService(version, TINY_ARCH, torch.device("cpu"), "torchscript", voice_store=url)
    try:
        assert spoken(service.prepare({"TEXT": b("去重庆用AWS")})) == "去重庆用AWS"
        writer = L.open_lexicon_store(url)
        L.put_entry(writer, check_entry("重庆", "虫庆"))
        assert spoken(service.prepare({"TEXT": b("去重庆用AWS")})) == "去虫庆用AWS"  # SQLite: seen at once
        writer.delete("重庆")
        assert spoken(service.prepare({"TEXT": b("去重庆")})) == "去重庆"
    finally:
        service.close()


def test_reexport_keeps_the_lexicon(tiny_assets, tmp_path):
    from export.__main__ import export_repository

    out = tmp_path / "repo"
    export_repository(tiny_assets, out, ["torchscript"], progress=lambda m: None)
    assert not (out / LEXICON).exists()
    with L.editing(out) as entries:
        entries["重庆"] = check_entry("重庆", "虫庆")
    kept = (out / LEXICON).read_bytes()
    export_repository(tiny_assets, out, ["torchscript"], progress=lambda m: None)
    assert (out / LEXICON).read_bytes() == kept


# --- served -----------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_lexicon_edit_is_heard_by_the_running_server_at_its_next_request(served_tiny):
    from client import ChatTTSClient

    repo = served_tiny.model_repository
    assert not (repo / LEXICON).exists()
    fixed = dict(seed=2, max_new_tokens=8, min_new_tokens=8, split=False)
    try:
        with ChatTTSClient(served_tiny.grpc_url) as c:
            def said(text: str, stream: bool = False) -> str:
                told = []
                if stream:
                    list(c.stream(text, voice_from_first=False, on_spoken_text=told.append, **fixed))
                else:
                    c.synthesize(text, on_spoken_text=told.append, **fixed)
                return told[0]

            assert said("我在重庆用AWS。") == "我在重庆用AWS。"
            assert L.main(["--repo", str(repo), "add", "重庆", "虫庆"]) == 0
            assert L.main(["--repo", str(repo), "add", "aws", "A W S", "--ignore-case"]) == 0
            assert said("我在重庆用AWS。") == "我在虫庆用A W S。"
            assert said("重庆", stream=True) == "虫庆"  # the stream model reads the same file
            assert L.main(["--repo", str(repo), "remove", "重庆"]) == 0
            assert said("我在重庆用AWS。") == "我在重庆用A W S。"
    finally:  # the repository is left as the session's other tests expect it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(repo / LEXICON)
