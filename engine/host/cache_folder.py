"""Folders built once under the cache root (`$FP4SERVE_CACHE`, else `~/.cache/fp4serve`): each is
written in a staging folder and renamed into place, so a reader sees a complete folder or none;
staging folders left by killed builds are removed by the next build."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("fp4serve.cache")

MARKER_FILE = "fp4serve_complete.json"
_STAGING = ".tmp-"  # staging folders are named .{final}.tmp-{pid}-{random}


def cache_root() -> Path:
    """fp4serve's cache root: `$FP4SERVE_CACHE`, else `~/.cache/fp4serve`."""
    env = os.environ.get("FP4SERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fp4serve"


def is_complete(folder: Path) -> bool:
    """True when the marker exists and every file it lists is there at its recorded size."""
    try:
        files = json.loads((folder / MARKER_FILE).read_text())["files"]
        return all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, built by `build(staging_folder)` unless a complete copy is there. Safe when several
    processes race: each builds in its own staging folder; the first rename wins."""
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(final)
    if final.exists():  # damaged by hand (the folder only ever appears complete, by rename)
        _move_aside_and_remove(final)
    staging = final.with_name(f".{final.name}{_STAGING}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        build(staging)
        # The marker goes last: a folder with a valid marker is complete.
        files = sorted(p for p in staging.iterdir() if p.is_file())
        for file in files:  # a shared FP4SERVE_CACHE stays readable by every user
            file.chmod(0o644)
        staging.chmod(0o755)
        sizes = {p.name: p.stat().st_size for p in files}
        (staging / MARKER_FILE).write_text(json.dumps({"files": sizes}, indent=2) + "\n")
        try:
            os.rename(staging, final)
        except OSError:
            if not is_complete(final):
                raise
            logger.info("another process built %s first; using it", final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def remove_stale_staging(final: Path) -> list[Path]:
    """Remove the staging folders of `final` whose building process is gone; returns them."""
    removed = []
    for folder in final.parent.glob(f".{final.name}{_STAGING}*"):
        pid = folder.name.removeprefix(f".{final.name}{_STAGING}").split("-", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        logger.info("removing %s, left by a build that did not finish", folder)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _move_aside_and_remove(folder: Path) -> None:
    # Moved first so that a racing process never sees it half-deleted.
    logger.warning("%s is incomplete or damaged; rebuilding it", folder)
    aside = folder.with_name(f".{folder.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)
