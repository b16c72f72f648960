"""The pronunciation lexicon of a model repository: `REPO/lexicon.json` beside voices.json, read by every model that
prepares a request (`chattts_preprocess`, `chattts_stream`) and so shared by every replica serving the repository.
The matching rules are chattts_triton.model.lexicon's; docs/ssml.md#pronunciation-lexicon is the user's guide.

    python -m chattts_triton.lexicon --repo REPO list
    python -m chattts_triton.lexicon --repo REPO add 重庆 虫庆
    python -m chattts_triton.lexicon --repo REPO add nvidia "en vidia" --ignore-case
    python -m chattts_triton.lexicon --repo REPO remove 重庆
    python -m chattts_triton.lexicon --repo REPO apply "重庆的银行"     # what the lexicon makes of a text

Edits are atomic (written aside, renamed over lexicon.json, under the lock on the repository folder the voices CLI
takes); a running server sees them at its next request (the file's identity is checked each time). A lexicon.json
that cannot be read (a hand edit gone wrong) is logged and the last good version stays in use; none: no lexicon.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from ..config import LEXICON
from ..model.lexicon import Lexicon, LexiconError, check_entry, from_json, to_json

log = logging.getLogger(__name__)


def read_lexicon(path: Path) -> Lexicon:
    """The lexicon in `path`; LexiconError saying why it cannot be used."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LexiconError(f"{path} cannot be read: {e}") from None
    try:
        return from_json(doc)
    except LexiconError as e:
        raise LexiconError(f"{path}: {e}") from None


def write_lexicon(path: Path, lexicon: Lexicon) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(to_json(lexicon), f, indent=2, ensure_ascii=False)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def editing(repo: Path) -> Iterator[dict]:
    """The entries of `repo`'s lexicon (word -> Entry) to change in place; written back when the block ends without
    an error. Serialised with every other edit of the repository by a lock on its folder."""
    repo = Path(repo)
    fd = os.open(repo, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = repo / LEXICON
        entries = {e.word: e for e in (read_lexicon(path).entries() if path.exists() else [])}
        yield entries
        write_lexicon(path, Lexicon(entries.values()))
    finally:
        os.close(fd)  # releases the lock


class LexiconRegistry:
    """`repo`'s lexicon as of its file now: re-read when the file changes (a stat per request)."""

    def __init__(self, repo: Path):
        self.path = Path(repo) / LEXICON
        self._lock = threading.Lock()
        self._key: tuple | None = ("unread",)
        self._lexicon = Lexicon()

    def _identity(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_dev, st.st_mtime_ns, st.st_size

    def current(self) -> Lexicon:
        key = self._identity()
        with self._lock:
            if key != self._key:
                try:
                    self._lexicon = read_lexicon(self.path) if key is not None else Lexicon()
                except LexiconError as e:  # a server-side fault: the requests go on with the last good version
                    log.error("pronunciation lexicon: %s; still using the last good one (%d entries)", e,
                              len(self._lexicon))
                self._key = key
            return self._lexicon

    def apply(self, text: str) -> str:
        return self.current().apply(text)


# --- command line ------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chattts_triton.lexicon",
                                 description=f"List, add and remove the pronunciation lexicon's entries of a model "
                                             f"repository (REPO/{LEXICON}).")
    ap.add_argument("--repo", type=Path, required=True, help="an exported model repository")
    sub = ap.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="the entries")
    ls.add_argument("--json", action="store_true", help=f"{LEXICON}'s content")
    add = sub.add_parser("add", help="add (or with --force replace) an entry")
    add.add_argument("word", help="the word as written (exact, case included)")
    add.add_argument("say", help="what to say instead: a homophone or a respelling (control tokens allowed)")
    add.add_argument("--ignore-case", action="store_true", help="match the word in any case of A-Z")
    add.add_argument("--force", action="store_true", help="replace the entry of that word")
    rm = sub.add_parser("remove", help="remove an entry")
    rm.add_argument("word")
    ap_apply = sub.add_parser("apply", help="print what the lexicon makes of a text")
    ap_apply.add_argument("text")
    a = ap.parse_args(argv)

    repo = a.repo
    if not repo.is_dir():
        print(f"error: {repo} is not a folder: --repo must be an exported repository (make export)", file=sys.stderr)
        return 1
    path = repo / LEXICON
    try:
        if a.command in ("list", "apply"):
            lexicon = read_lexicon(path) if path.exists() else Lexicon()
            if a.command == "apply":
                print(lexicon.apply(a.text))
            elif a.json:
                print(json.dumps(to_json(lexicon), indent=2, ensure_ascii=False))
            else:
                for e in lexicon.entries():
                    print(f"{e.word}\t{e.say}" + ("\t(any case)" if e.ignore_case else ""))
            return 0
        if a.command == "add":
            entry = check_entry(a.word, a.say, a.ignore_case)
            with editing(repo) as entries:
                if a.word in entries and not a.force:
                    raise LexiconError(f"the lexicon has {a.word!r} (says {entries[a.word].say!r}); "
                                       "--force replaces it")
                entries[a.word] = entry
            print(f"added {entry.word} -> {entry.say}")
        else:
            with editing(repo) as entries:
                if entries.pop(a.word, None) is None:
                    raise LexiconError(f"the lexicon has no entry {a.word!r}")
            print(f"removed {a.word}")
    except (LexiconError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
