"""Headless Chromium driven by Selenium, for the tools and tests that look at the web pages.

This module owns starting the browser (Debian's ``chromium`` and ``chromedriver`` from PATH, with
the flags a headless run in a container needs) and waiting for a page to show something, so that
``python -m echo.tools.screenshots`` and tests/e2e/test_dashboard_browser.py drive the same
browser the same way. Selenium is imported only when a browser is started: the rest of echo
does not need it.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

INSTALL = "apt-get install chromium chromium-driver; selenium is in the dev extra"


class BrowserMissing(RuntimeError):
    """Chromium, chromedriver or selenium is not installed here."""


class PageTimeout(AssertionError):
    """A page did not show what was waited for in time.

    An AssertionError, so that a test waiting on a page fails (rather than errors) on it."""


def missing() -> str | None:
    """What is missing to start headless Chromium here, as one sentence; None when nothing is."""
    lacking = [
        name
        for name, found in (
            ("chromium", _chromium() is not None),
            ("chromedriver", shutil.which("chromedriver") is not None),
            ("selenium", importlib.util.find_spec("selenium") is not None),
        )
        if not found
    ]
    if not lacking:
        return None
    return f"{' and '.join(lacking)} not installed ({INSTALL})"


def headless_chromium(width: int, height: int) -> WebDriver:
    """A headless Chromium window of ``width`` x ``height`` CSS pixels; the caller quits it.

    :raises BrowserMissing: chromium, chromedriver or selenium is not installed.
    """
    reason = missing()
    if reason is not None:
        raise BrowserMissing(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = _chromium()
    for arg in (
        "--headless=new",
        # Containers run as root without user namespaces, where Chromium's sandbox cannot start,
        # and with a small /dev/shm that crashes its renderers on tall pages.
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        # Screenshots are of the page, not of the window's scrollbars.
        "--hide-scrollbars",
    ):
        opts.add_argument(arg)
    service = Service(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(options=opts, service=service)


def wait_for(
    driver: WebDriver,
    what: str,
    predicate: Callable[[WebDriver], Any],
    timeout_s: float,
    poll_s: float = 0.2,
) -> Any:
    """Poll ``predicate(driver)`` until it is truthy and return its value.

    :raises PageTimeout: naming ``what``, when it was not truthy within ``timeout_s``.
    """
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=poll_s).until(predicate)
    except TimeoutException as exc:
        raise PageTimeout(f"the page never showed {what} in {timeout_s:g} s") from exc


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")
