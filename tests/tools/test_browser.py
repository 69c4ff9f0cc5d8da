"""echo.tools.browser: the headless Chromium the screenshots tool and the dashboard test share,
started for real on a small page (skipped, saying what is missing, without chromium,
chromedriver or selenium)."""

from __future__ import annotations

import time
import urllib.parse

import pytest

from echo.tools import browser

PAGE = (
    "<p id=now>now</p><p id=later hidden>later</p>"
    "<script>setTimeout(() => document.getElementById('later').hidden = false, 300)</script>"
)


def test_headless_chromium_waits_for_what_the_page_shows() -> None:
    reason = browser.missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium.webdriver.common.by import By

    driver = browser.headless_chromium(640, 480)
    try:
        assert driver.get_window_size() == {"width": 640, "height": 480}
        driver.get("data:text/html," + urllib.parse.quote(PAGE))
        shown = browser.wait_for(
            driver,
            "the late paragraph",
            lambda d: d.find_element(By.ID, "later").is_displayed()
            and d.find_element(By.ID, "later"),
            timeout_s=20,
        )
        assert shown.text == "later"

        start = time.monotonic()
        with pytest.raises(browser.PageTimeout, match="never showed the missing table in 1 s"):
            browser.wait_for(
                driver, "the missing table", lambda d: d.find_elements(By.ID, "t"), timeout_s=1
            )
        assert 1.0 <= time.monotonic() - start < 10
    finally:
        driver.quit()


def test_missing_names_what_is_not_installed(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    reason = browser.missing()
    assert reason is not None
    assert reason.startswith("chromium and chromedriver not installed")
    with pytest.raises(browser.BrowserMissing, match="chromium and chromedriver"):
        browser.headless_chromium(640, 480)
