"""The chat page at ``GET /`` in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
installed by ``make test``; never a downloaded browser), driven through selenium.

Load the page, type the API key and a message, see the answer stream in (its text grows while the
request runs), press Stop: the request is aborted on the server (its KV blocks are free again) and
the page shows the answer's TTFT. The server is ``echo_http`` (EchoRunner: a long, steady stream).
"""

import os
import shutil
import tempfile

import pytest
from support.serve_helpers import API_KEY
from support.serve_helpers import idle_metrics, poll_until

from folio.ipc.client import Client

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1200,900"]


def _missing(why: str):
    """Skip, or fail where ``FOLIO_REQUIRE_BROWSER=1`` (``make test`` sets it: CI must run this test)."""
    if os.environ.get("FOLIO_REQUIRE_BROWSER", "") not in ("", "0"):
        pytest.fail(f"{why} (FOLIO_REQUIRE_BROWSER=1)")
    pytest.skip(why)


@pytest.fixture
def browser():
    try:
        from selenium import webdriver
    except ImportError:
        _missing("selenium is in the test extra: pip install -e '.[test]'")
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        _missing("chromium and chromium-driver are not installed (make test installs them with apt-get, "
                 "or stops saying why)")
    from selenium.webdriver.chrome.service import Service
    profile = tempfile.mkdtemp(prefix="folio-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_chat_page_streams_and_stops(browser, echo_http):   # browser first: a missing one stops before the server starts
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    _, address, url = echo_http
    with Client(address, timeout=60) as zc:
        idle = idle_metrics(zc)
        aborts = idle["serving"]["request_success"].get("abort", 0)
        browser.get(url + "/")
        assert browser.title == "folio chat"
        assert browser.find_element(By.ID, "model").text == "echo"
        assert browser.find_element(By.ID, "stop").get_attribute("disabled")
        browser.find_element(By.ID, "api-key").send_keys(API_KEY)
        browser.find_element(By.ID, "max-tokens").clear()
        browser.find_element(By.ID, "max-tokens").send_keys("3000")
        browser.find_element(By.ID, "input").send_keys("Tell me a long story.")
        browser.find_element(By.ID, "input").send_keys(Keys.ENTER)

        def answer():
            return browser.execute_script(
                "const c = document.querySelectorAll('.msg.assistant .content'); "
                "return c.length ? c[c.length - 1].textContent : null")

        first = poll_until(lambda: answer() or None, 60, "streamed text to appear")
        poll_until(lambda: len(answer()) > len(first) + 5, 60, "the streamed text to grow")
        assert browser.find_element(By.ID, "status").text == "streaming"
        assert zc.get_metrics()["num_running"] == 1
        browser.find_element(By.ID, "stop").click()
        poll_until(lambda: browser.find_element(By.ID, "status").text == "idle", 30, "the page to stop")
        stats = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text
        assert "TTFT" in stats and "stopped" in stats and "tokens/s" in stats, stats
        # the server aborted the request: its blocks are free again
        m = poll_until(lambda: (lambda m: m if m["num_running"] == 0 and m["num_free_blocks"] == idle["num_free_blocks"]
                                else None)(zc.get_metrics()), 30, "the request to be aborted")
        assert m["serving"]["request_success"]["abort"] == aborts + 1
        assert browser.find_element(By.CSS_SELECTOR, ".msg.user .content").text == "Tell me a long story."
        # a second turn works after a stop (the page is not left busy)
        browser.find_element(By.ID, "max-tokens").clear()
        browser.find_element(By.ID, "max-tokens").send_keys("5")
        browser.find_element(By.ID, "input").send_keys("Again", Keys.ENTER)
        poll_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 2, 60,
                   "the second answer to finish")
        last = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[-1].text
        assert "5 tokens" in last and "stopped at max tokens" in last, last
