"""A real headless browser for the pages' tests (serving/test_pages.py, launch/test_router.py):
Debian's `chromium` driven through its `chromium-driver` by selenium (nothing downloaded:
both paths are given, so selenium's manager is never asked). The driver starts in a session
of its own, and the browser's processes with it: close() ends that session whole."""

import os
import shutil
import signal
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from conftest import needs, session_members

SCREENSHOTS_ENV = "TRINITY_SCREENSHOTS"  # a folder for the pages' screenshots (the docs' pictures: docs/)
WAIT_S = 60


def installed() -> tuple:
    """chromium and its driver, or the test is skipped naming them (under CI=true: fails)."""
    browser = shutil.which("chromium") or "/usr/bin/chromium"
    driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if not (Path(browser).exists() and Path(driver).exists()):
        needs("chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    return browser, driver


class Browser:
    def __init__(self, width=1100, height=800):
        browser, driver = installed()
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    "--no-first-run", "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--disable-default-apps", f"--window-size={width},{height}"):
            options.add_argument(arg)  # --no-sandbox: tests run as root here
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.service = Service(driver, popen_kw={"start_new_session": True})
        self.driver = webdriver.Chrome(options=options, service=self.service)
        self.session = self.service.process.pid

    def open(self, url: str) -> None:
        self.driver.get(url)

    def wait(self, condition, what: str, timeout: float = WAIT_S):
        """Wait until condition() is truthy (an explicit wait, on the page's own state)."""
        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(
            lambda _: condition(), message=f"{what}: not within {timeout} s")

    def find(self, css: str):
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str):
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def js(self, script: str, *args):
        """The value of `script` run in the page: a read in one step (the status page redraws
        itself every second, so an element found before may be gone when read)."""
        return self.driver.execute_script(script, *args)

    def text(self, css: str) -> str:
        return self.js("const n = document.querySelector(arguments[0]); return n ? n.innerText : ''", css)

    def attribute(self, css: str, name: str) -> str:
        return self.js("const n = document.querySelector(arguments[0]); return n && n.getAttribute(arguments[1]) || ''",
                       css, name)

    def console_errors(self) -> list:
        """The browser's console entries of level SEVERE since the last call (JavaScript
        errors, failed loads, CSP violations)."""
        return [e for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def screenshot(self, name: str, fallback: Path) -> Path:
        """The page as PNG, in $TRINITY_SCREENSHOTS if set (the docs' pictures), else `fallback`."""
        folder = Path(os.environ.get(SCREENSHOTS_ENV) or fallback)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        size = self.driver.get_window_size()
        self.driver.set_window_size(size["width"], self.js("return document.documentElement.scrollHeight") + 120)
        try:  # the whole page, not the window's first screen
            assert self.driver.save_screenshot(str(path)), path
        finally:
            self.driver.set_window_size(size["width"], size["height"])
        return path

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            for pid in session_members(self.session):  # anything the quit left
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + 10
            while session_members(self.session) and time.monotonic() < end:
                time.sleep(0.05)  # zombies until their parent (or init) reaps them
            assert not session_members(self.session), "the browser left processes behind"


# What the status page (distributed/serving/pages/status.js) shows.

def page_state(browser: Browser) -> str:
    """The status badge's state: serving, loading, down, recovering, stopping or unreachable."""
    return browser.attribute("#state", "data-state")


def ranks(browser: Browser) -> list:
    """Each rank's box: its data (rank, host, start, end), its text and width in pixels."""
    return browser.js("return [...document.querySelectorAll('.rank')].map((n) => Object.assign({}, n.dataset, "
                      "{text: n.innerText, width: n.getBoundingClientRect().width}))")


def counter(browser: Browser, name: str) -> str:
    return browser.text(f'[data-counter="{name}"] dd')


def events(browser: Browser) -> list:
    """The states the page saw, oldest first."""
    return browser.js("return [...document.querySelectorAll('#events li')].reverse().map((n) => n.dataset.state)")


# What the chat page (pages/chat.js) does.

def chat(browser: Browser, text: str, max_tokens: int, temperature: str = "0"):
    """Type `text` and Enter with these settings; returns the reply's element once it begins
    (its data-finish is set when it ends: a finish reason, "stopped" or "error")."""
    for field, value in (("#temperature", temperature), ("#max-tokens", str(max_tokens))):
        browser.find(field).clear()
        browser.find(field).send_keys(value)
    replies = len(browser.all(".message.assistant"))
    browser.find("#message").send_keys(text, Keys.ENTER)
    browser.wait(lambda: len(browser.all(".message.assistant")) == replies + 1, "a reply begins")
    return browser.all(".message.assistant")[-1]
