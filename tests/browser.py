"""A real headless Chromium for tests of the web page, driven by selenium through Debian's
`chromium` and `chromium-driver` (installed with apt-get when missing, as root; CI runs as root),
plus small helpers to read the page. Screenshots go to test-artifacts/ui/ (git-ignored)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.remote.webelement import WebElement

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts" / "ui"
APT_PACKAGES = ("chromium", "chromium-driver")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1440,900",
)
INSTALL_TIMEOUT_S = 900
T = TypeVar("T")


def chromium_paths() -> tuple[str, str] | None:
    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


def ensure_chromium() -> tuple[str, str]:
    """Debian's chromium and chromedriver, installed with apt-get when missing; a skip saying
    why when they cannot be installed here."""
    found = chromium_paths()
    if found:
        return found
    if not shutil.which("apt-get"):
        pytest.skip("the browser tests need Debian's chromium and chromium-driver, and this system has no apt-get")
    if os.geteuid() != 0:
        pytest.skip(
            "the browser tests need chromium and chromium-driver: run `apt-get install chromium "
            "chromium-driver` as root, or run the tests as root so that they install them"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ("-o", "DPkg::Lock::Timeout=300")
    for command in (
        ["apt-get", *lock, "update", "-q"],
        ["apt-get", *lock, "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES],
    ):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`{' '.join(command)}` took over {INSTALL_TIMEOUT_S} s; the browser tests need chromium")
        if done.returncode != 0:
            pytest.skip(
                f"could not install chromium for the browser tests: `{' '.join(command)}` exited "
                f"{done.returncode}: {(done.stderr or done.stdout)[-600:]}"
            )
    found = chromium_paths()
    if not found:
        pytest.skip("apt-get installed chromium and chromium-driver, but they are not on PATH")
    return found


@contextmanager
def chromium() -> Iterator[WebDriver]:
    """A fresh headless Chromium with its own profile folder, closed afterwards."""
    from selenium import webdriver  # the `test` extra: missing, it is an error, not a skip (tests/conftest.py)

    binary, driver_path = ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with tempfile.TemporaryDirectory(prefix="fp4serve-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def screenshot(driver: WebDriver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def wait_for(condition: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """The first truthy value of `condition()`, polled; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def by_testid(driver: WebDriver | WebElement, testid: str) -> list[WebElement]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, f'[data-testid="{testid}"]')


def console_errors(driver: WebDriver) -> list[dict[str, Any]]:
    """Console messages of level SEVERE (script errors, CSP violations, failed loads)."""
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
