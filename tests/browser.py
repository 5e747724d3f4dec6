"""What the browser tests share: Debian's Chromium driven by Playwright, and `dex-tasks api` as a
real process on a free port."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.helpers import free_port, start_process, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SECRET = "test-secret-key"  # tests.conftest.fast_settings


def playwright_or_skip() -> ModuleType:
    """``playwright.sync_api``; skips the module where Chromium is missing (fails on CI)."""
    module = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            raise RuntimeError(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)",
                    allow_module_level=True)
    return module


@dataclass
class ApiProcess:
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes]


@contextmanager
def api_process(env: dict[str, str], tmp_path: Path) -> Iterator[ApiProcess]:
    """``dex-tasks api`` as a subprocess on a free port, stopped at the end."""
    port = free_port()
    log_path = tmp_path / "api.log"
    proc = start_process(["api", "--host", "127.0.0.1", "--port", str(port)], env, log_path)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"dex-tasks api exited:\n{log_path.read_text()}")
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, 30, "dex-tasks api to answer /healthz")
    try:
        yield ApiProcess(url, log_path, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# Everything that sticks out past the viewport's right edge (or the page's own scroll width
# beyond the viewport): what makes a phone scroll sideways.
_OVERFLOW_JS = """() => {
  const width = window.innerWidth;
  const wide = [];
  for (const el of document.body.querySelectorAll("*")) {
    const box = el.getBoundingClientRect();
    if (box.width === 0 && box.height === 0) continue;
    if (box.right > width + 0.5 || box.left < -0.5) {
      wide.push(el.tagName.toLowerCase() + "." + el.className + " " +
                Math.round(box.left) + ".." + Math.round(box.right));
    }
  }
  return {scrollWidth: document.scrollingElement.scrollWidth, innerWidth: width, wide: wide};
}"""


def horizontal_overflow(page: Any) -> list[str]:
    """What would make the page scroll sideways; empty when nothing does."""
    found = page.evaluate(_OVERFLOW_JS)
    problems = list(found["wide"])
    if found["scrollWidth"] > found["innerWidth"]:
        problems.append(f"scrollWidth {found['scrollWidth']} > innerWidth {found['innerWidth']}")
    return problems


def within_viewport_width(page: Any, locator: Any) -> bool:
    """Whether ``locator``'s box lies inside the viewport's width (no sideways scroll needed)."""
    box = locator.bounding_box()
    return box is not None and box["x"] >= 0 and \
        box["x"] + box["width"] <= page.viewport_size["width"]


@contextmanager
def chromium_page(playwright: ModuleType, url: str, *, width: int = 1280,
                  height: int = 900) -> Iterator[tuple[Any, list[str]]]:
    """Headless Chromium open on ``url``: the page, and the list its script errors go to."""
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(url)
            yield page, errors
        finally:
            browser.close()
