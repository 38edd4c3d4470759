"""What ``kilnproxy serve`` does to its own process once it is set up (``kilnproxy.web.server.settle_gc``).

Run in a process of its own: the collector's settings are the process's, not the test runner's."""

import subprocess
import sys

from kilnproxy.web.server import YOUNG_THRESHOLD


def test_settle_gc_freezes_what_start_up_made_and_raises_the_young_threshold():
    code = ("import gc; from kilnproxy.web import server; before = gc.get_threshold(); "
            "keep = [[n] for n in range(1000)]; server.settle_gc(); "
            "print(before[1:] == gc.get_threshold()[1:], gc.get_threshold()[0], gc.get_freeze_count() >= 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", str(YOUNG_THRESHOLD), "True"]
