"""Headless Chromium (Debian's `chromium`) for page tests: the DOM after the page's scripts ran."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise AssertionError(
            "headless Chromium is needed: apt-get install chromium"
            " (scripts/test-services.sh, run by make test, installs it)"
        )
    return path


def dump_dom(url: str, *, budget_ms: int = 4000, timeout_s: float = 90.0) -> str:
    """Load ``url`` in a fresh profile, let its scripts run for ``budget_ms`` of virtual time,
    and return the serialised DOM."""
    with tempfile.TemporaryDirectory(prefix="aisp-chromium-") as profile:
        cmd = [chromium(), *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}"]
        done = subprocess.run(
            [*cmd, "--dump-dom", url], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
