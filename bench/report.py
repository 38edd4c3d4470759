"""Figures -> Markdown: medians with min–max, one table per measurement, machine and versions on top."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib.metadata import version
from statistics import median


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    """``median (min–max)`` of repeated figures."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def ratio(values: list[float], base: list[float]) -> str:
    """Median of per-round ratios, as a percentage of ``base``."""
    pairs = [v / b * 100 for v, b in zip(values, base) if b]
    return spread(pairs, "{:.0f}%") if pairs else "-"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _run(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (out.stdout + out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "?"


def machine() -> str:
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        kib = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
        mem = f"{kib / 1024 / 1024:.1f} GiB"
    except (OSError, StopIteration):
        pass
    packages = ", ".join(f"{p} {version(p)}" for p in ("aiohttp", "uvloop", "orjson", "aiosqlite", "pluggy"))
    rev = _run(["git", "-C", os.path.dirname(__file__), "describe", "--always", "--dirty"])
    return "\n".join([
        f"- machine: {cpu}, {os.cpu_count()} CPUs, {mem} RAM, Linux {platform.release()}",
        f"- kilnproxy {rev}; Python {sys.version.split()[0]}; {packages}",
        f"- {_run(['nginx', '-v'])}; {_run(['wrk', '-v'])[:40].strip()}",
        "- load average when the run ended (1, 5, 15 min): {:.1f}, {:.1f}, {:.1f} (other work on the machine "
        "makes the figures noisier)".format(*os.getloadavg()),
    ])
