"""tools/gpu_session.sh's stages that only arrange other commands, run here with stand-ins for python3 and
nvidia-smi (the GPU host's own run is what the stages are for)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stand_ins(tmp_path: Path, record: str) -> tuple[dict, Path]:
    """An environment whose python3 appends `record` (shell words) to calls.txt and whose nvidia-smi names a card,
    with an empty bundle env file; and the calls file."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "{record}" >> {calls}\n')
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'name'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env_file = tmp_path / "env.sh"
    env_file.write_text("")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), CHATTTS_ENV=str(env_file))
    return env, calls


def test_ab_runs_each_entry_from_its_tree_with_the_common_flags_and_its_own(tmp_path):
    env, calls = _stand_ins(tmp_path, "$PWD|$PYTHONPATH|$*")
    old = tmp_path / "old"
    old.mkdir()
    env.update(BENCH_ARGS="--skip-upstream --max-concurrency 8", AB_RUNS=f"new=;before@{old}=--instances 2 --mps")
    r = subprocess.run(["bash", str(ROOT / "tools/gpu_session.sh"), "ab"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 2
    (cwd0, path0, args0), (cwd1, path1, args1) = (line.split("|") for line in lines)
    assert cwd0 == str(ROOT) and path0.startswith(f"{ROOT}:")
    assert args0.split() == ["-m", "bench.run", "--assets", f"{ROOT}/build/assets-full", "--out",
                             f"{tmp_path}/out/ab-new", "--name", "new", "--repo", f"{ROOT}/build/repo-ab-new",
                             "--skip-upstream", "--max-concurrency", "8"]
    assert cwd1 == str(old) and path1.startswith(f"{old}:")  # the older tree's packages first
    assert args1.split()[4:12] == ["--out", f"{tmp_path}/out/ab-before", "--name", "before", "--repo",
                                   f"{ROOT}/build/repo-ab-before", "--skip-upstream", "--max-concurrency"]
    assert args1.split()[-3:] == ["--instances", "2", "--mps"]
    assert "ab before (tree " in (tmp_path / "out/ab.log").read_text()


def test_ab_packs_each_runs_folder_into_one_file_beside_its_log(tmp_path):
    """A device call brings back only a few files: each run's folder (JSON, md, plots, server log, perf CSVs) leaves
    as one archive, $OUT/ab-NAME.tgz, beside $OUT/ab-NAME.log."""
    import tarfile

    env, _ = _stand_ins(tmp_path, "")
    # python3 as bench.run: writes its files into --out (its 6th word)
    (tmp_path / "bin/python3").write_text('#!/bin/sh\nmkdir -p "$6/perf" && touch "$6/run.json" "$6/perf/c1.csv"\n'
                                          'echo done\n')
    env.update(AB_RUNS="one=;two=--mps")
    r = subprocess.run(["bash", str(ROOT / "tools/gpu_session.sh"), "ab"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["ab-one.log", "ab-one.tgz", "ab-two.log", "ab-two.tgz", "ab.log",
                                                     "gpu.txt"]
    with tarfile.open(out / "ab-two.tgz") as t:
        assert sorted(t.getnames()) == ["ab-two", "ab-two/perf", "ab-two/perf/c1.csv", "ab-two/run.json"]


def test_ab_without_runs_says_what_it_needs(tmp_path):
    env_file = tmp_path / "env.sh"
    env_file.write_text("")
    env = dict(os.environ, OUT=str(tmp_path / "out"), CHATTTS_ENV=str(env_file))
    env.pop("AB_RUNS", None)
    r = subprocess.run(["bash", str(ROOT / "tools/gpu_session.sh"), "ab"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "AB_RUNS names the runs" in r.stderr


def test_ab_refuses_an_entry_without_its_equals_sign_before_any_run(tmp_path):
    env, calls = _stand_ins(tmp_path, "$*")
    env["AB_RUNS"] = "one=;two --instances 2"
    r = subprocess.run(["bash", str(ROOT / "tools/gpu_session.sh"), "ab"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "'two --instances 2' has no '='" in r.stderr
    assert not calls.exists()  # not even the first, well-formed entry ran
