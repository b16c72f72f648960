"""loadtest.lengths: the code frames each request of a load tool forces, N or drawn from A-B, and the flags that take
them."""

from __future__ import annotations

import pytest

from chattts_triton.config import LIMITS
from loadtest.lengths import Lengths


def test_a_single_length_and_a_range_parse():
    assert Lengths.parse("150") == Lengths(150, 150) and Lengths.parse("150").fixed
    r = Lengths.parse(" 50 - 400 ", seed=3)
    assert (r.low, r.high, r.seed, r.fixed, r.mean) == (50, 400, 3, False, 225.0)
    assert str(r) == "50-400" and str(Lengths.parse(150)) == "150"
    assert Lengths.of(8) == Lengths(8, 8) and Lengths.of(r) is r
    assert Lengths.parse(f"1-{LIMITS.max_new_tokens}").high == LIMITS.max_new_tokens


@pytest.mark.parametrize("bad", ["0", "0-5", "9-3", f"1-{LIMITS.max_new_tokens + 1}", "a", "", "5-", "-5",
                                 "1.5", "3-4-5"])
def test_a_bad_length_is_refused(bad):
    with pytest.raises(ValueError):
        Lengths.parse(bad)


def test_the_draws_repeat_for_a_seed_and_a_key_and_stay_in_range():
    r = Lengths(4, 9, seed=1)
    a = r.draw(400, "sweep", 8, 3)
    assert a == Lengths(4, 9, seed=1).draw(400, "sweep", 8, 3)  # a fresh object, the same stream
    assert set(a) == set(range(4, 10))  # every length, both ends included, nothing outside
    assert a != r.draw(400, "sweep", 8, 4) and a != Lengths(4, 9, seed=2).draw(400, "sweep", 8, 3)
    assert a[:10] == [x for x, _ in zip(r.stream("sweep", 8, 3), range(10), strict=False)]  # draw is the stream's start
    assert Lengths(7, 7).draw(5, "burst") == [7] * 5


def test_spread_gives_distinct_lengths_over_the_whole_range():
    s = Lengths(50, 400).spread(16)
    assert len(s) == 16 and s == sorted(set(s)) and (s[0], s[-1]) == (50, 400)
    assert Lengths(3, 5).spread(16) == [3, 4, 5] and Lengths(150, 150).spread(16) == [150]


def test_the_report_says_which_lengths_and_how_much_audio():
    assert Lengths(150, 150).describe() == "150 forced code frames per utterance (≈ 3.19 s of audio)"
    d = Lengths(50, 400, seed=2).describe()
    assert "50–400" in d and "seed 2" in d and "mean 225 frames" in d
    assert Lengths(50, 400).to_json()["frames"] == "50-400"


@pytest.mark.parametrize("tool,flag", [("bench.run", "--tokens"), ("bench.perf", "--frames"),
                                       ("loadtest.soak", "--frames"),
                                       ("loadtest.sweep", "--tokens")])
@pytest.mark.parametrize("value", ["0", "300-200", f"10-{LIMITS.max_new_tokens + 1}", "x"])
def test_every_flag_that_takes_lengths_refuses_a_bad_one_by_name(tool, flag, value, capsys):
    import importlib

    main = importlib.import_module(tool).main
    with pytest.raises(SystemExit) as e:
        main(["--assets", "/nonexistent", f"{flag}={value}"] if tool == "bench.run" else [f"{flag}={value}"])
    assert e.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err


def test_bench_run_refuses_a_range_for_upstream(capsys):
    """Upstream's Chat.infer forces one length per call: a mixed run serves ours alone (--skip-upstream)."""
    from bench import run

    with pytest.raises(SystemExit) as e:
        run.main(["--assets", "/nonexistent", "--tokens", "50-400"])
    assert e.value.code == 2 and "--tokens A-B needs --skip-upstream" in capsys.readouterr().err


def test_bench_report_names_a_range_and_flags_answers_not_of_the_forced_length():
    from bench.run import to_markdown

    res = {"date": "d", "device_name": "GPU", "tokens": "50-400", "tokens_seed": 4, "dtype": "bf16",
           "served": [{"concurrency": 1, "error_rate": 0.0, "throughput_utt_s": 2.0, "audio_s_per_s": 9.6,
                       "frames_mismatched": 3}],
           "burst": {"requests": 2, "served": 2, "refused": 0, "errors": {}, "wall_s": 1.0, "latency_p50_ms": 1.0,
                     "latency_p99_ms": 1.0, "audio_s": 4.2, "frames_mismatched": 1}}
    md = to_markdown(res)
    assert md.splitlines()[2].startswith("Forced code frames drawn per utterance uniformly from 50–400 (seed 4;")
    assert "**4 answers were not of the length their request forced**" in md and ", 4.2 s of audio" in md
    assert "| 1 |  |  |  | 2.0 | 9.6 |" in md  # audio s/s beside utterances/s
    assert "not of the length" not in to_markdown({**res, "served": [],
                                                   "burst": {**res["burst"], "frames_mismatched": 0}})
