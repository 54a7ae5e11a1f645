"""Reliability under load: no leaks over many async saves."""

import json
import subprocess
import sys

from helpers import ROOT, child_env


def test_many_async_saves_leak_nothing():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak_leaks.py"), "--saves", "30", "--mib", "24"],
        env=child_env(SHARDCKPT_LOG_LEVEL="WARNING"), capture_output=True, text=True, timeout=600, check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["committed"] == [29, 30]
    assert report["rss_growth_pct"] < 5.0, report
    assert report["after_close"]["fds"] == report["before"]["fds"], report
    assert report["after_close"]["python_threads"] == report["before"]["python_threads"], report
    assert report["after_close"]["children"] == 0, report


def test_sigkill_at_every_kill_point_loses_nothing(tmp_path):
    """The CI-sized crash-consistency soak: one SIGKILL at each named point, one at random."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import soak_kill

    from shardckpt import _failpoints

    cycle = "p" * len(_failpoints.POINTS) + "r"
    stats = soak_kill.run_trials(len(cycle), seed=1, work=tmp_path, cycle=cycle)
    assert stats["failures"] == []
    assert stats["lost_committed"] == 0
    reached = {k for k in stats["points"] if not k.endswith("(not reached)")}
    assert set(_failpoints.POINTS) <= reached, stats["points"]
    assert stats["max_step"] > 0
