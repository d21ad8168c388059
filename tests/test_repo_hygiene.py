"""The tracked files carry no merge-conflict markers: a merge resolved in code but not in a doc
once left them in docs/ARCHITECTURE.md and docs/PERF.md, and nothing else would catch it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.M)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    suffixes = {
        ".py",
        ".md",
        ".toml",
        ".txt",
        ".cfg",
        ".yaml",
        ".yml",
        ".json",
        ".js",
        ".html",
        ".css",
        ".cpp",
        ".h",
        ".jinja",
        ".sh",
        "",
    }
    return [REPO / n for n in names.decode().split("\0") if n and Path(n).suffix in suffixes]


def test_no_conflict_markers_in_tracked_files() -> None:
    found = []
    for path in tracked_text_files():
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for m in MARKER.finditer(text):
            found.append(f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not found, "merge-conflict markers left in: " + ", ".join(found)
