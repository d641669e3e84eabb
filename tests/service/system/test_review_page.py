"""The reviewer page in a real headless Chromium (Debian's chromium + chromium-driver, selenium).

Loads ``/review`` from a running ``vge serve``, enters the reviewer key, labels the shown item with
a key press, skips the next with ``s``, marks the next *not a digit* with ``n`` (no class: the
API records ``not_a_digit``, the stats count it apart), and checks the API state changed. Keeps a screenshot
(``VGE_SCREENSHOT_DIR`` set: written there too, e.g. docs/ for the README).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import start_in_process

KEY = "page-reviewer-key"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    assert Path(chromium).exists() and Path(driver_path).exists(), (
        "Chromium is missing: run scripts/install-system-deps.sh"
    )
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--window-size=1100,760",
                 f"--user-data-dir={tmp_path / 'chromium'}"):  # fmt: skip
        opts.add_argument(flag)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium-manager go online
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(cond, timeout: float = 20.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _queue(url: str, pngs: list[bytes]) -> list[str]:
    """Queue ``pngs`` for review (``review=always``); their review ids, in order."""
    files = [("images", (f"{i}.png", p, "image/png")) for i, p in enumerate(pngs)]
    r = httpx.post(url + "/v1/predict?review=always", files=files, timeout=30, headers=H)
    assert r.status_code == 200, r.text
    return [x["review_id"] for x in r.json()["results"]]


def test_reviewer_labels_with_the_keyboard(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pngs: list[bytes], browser
) -> None:
    from selenium.webdriver.common.by import By

    work = tmp_path_factory.mktemp("review-page")
    srv = start_in_process(work, tiny_model, review_queue="on", reviewer_key=KEY)
    try:
        ids = _queue(srv.url, pngs[20:24])
        # The page and the images: a CSP (no framing, the page's own script only) and nosniff.
        for resp in (httpx.get(srv.url + "/review"),
                     httpx.get(f"{srv.url}/v1/reviews/{ids[0]}/image", headers=H)):  # fmt: skip
            csp = resp.headers["content-security-policy"]
            assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp, csp
            assert resp.headers["x-content-type-options"] == "nosniff"

        browser.get(srv.url + "/review")
        browser.find_element(By.ID, "key").send_keys(KEY)
        name = browser.find_element(By.ID, "reviewer")
        name.clear()
        name.send_keys("selenium")
        browser.find_element(By.ID, "start").click()

        body = browser.find_element(By.TAG_NAME, "body")
        shown = _wait(lambda: body.get_attribute("data-review-id"), what="the first item")
        assert shown == ids[0]  # oldest first
        _wait(lambda: browser.execute_script(
            "const i = document.getElementById('image'); return i.complete && i.naturalWidth;"
        ), what="the image")  # fmt: skip
        assert browser.find_element(By.ID, "depth").text == "4"
        buttons = browser.find_elements(By.CSS_SELECTOR, "#classes button.label")
        assert [b.text for b in buttons] == [str(i) for i in range(10)]
        assert browser.find_element(By.ID, "not-a-digit").text == "Not a digit (n)"
        topk = browser.find_elements(By.CSS_SELECTOR, "#topk tr")
        assert len(topk) == 5
        screenshot = work / "review-page.png"
        browser.save_screenshot(str(screenshot))
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("VGE_SCREENSHOT_DIR"):
            shutil.copy(screenshot, Path(os.environ["VGE_SCREENSHOT_DIR"]) / "review-page.png")

        body.send_keys("7")  # label the shown item "7" with the keyboard
        _wait(lambda: body.get_attribute("data-review-id") == ids[1], what="the next item")
        item = httpx.get(f"{srv.url}/v1/reviews/{ids[0]}", headers=H).json()
        assert (item["state"], item["label"], item["reviewer"]) == ("reviewed", "7", "selenium")

        body.send_keys("s")  # skip the second
        _wait(lambda: body.get_attribute("data-review-id") == ids[2], what="the third item")
        assert httpx.get(f"{srv.url}/v1/reviews/{ids[1]}", headers=H).json()["state"] == "skipped"

        body.send_keys("n")  # the third is not a digit: no class
        _wait(lambda: body.get_attribute("data-review-id") == ids[3], what="the fourth item")
        item = httpx.get(f"{srv.url}/v1/reviews/{ids[2]}", headers=H).json()
        assert (item["state"], item["label"], item["not_a_digit"]) == ("reviewed", None, True)

        # A button works as well; then the queue is empty.
        browser.find_element(By.CSS_SELECTOR, "#classes button[data-label='2']").click()
        _wait(lambda: browser.find_element(By.ID, "empty").is_displayed(), what="empty queue")
        assert httpx.get(f"{srv.url}/v1/reviews/{ids[3]}", headers=H).json()["label"] == "2"
        stats = httpx.get(f"{srv.url}/v1/reviews/stats", headers=H).json()
        assert stats["counts"] == {"pending": 0, "reviewed": 3, "skipped": 1}
        assert stats["labelled"] == 2 and stats["not_a_digit"]["count"] == 1
    finally:
        srv.stop()


def test_a_wrong_key_returns_to_the_login_form(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, browser
) -> None:
    from selenium.webdriver.common.by import By

    work = tmp_path_factory.mktemp("review-page-key")
    srv = start_in_process(work, tiny_model, review_queue="on", reviewer_key=KEY)
    try:
        browser.get(srv.url + "/review")
        browser.find_element(By.ID, "key").send_keys("not-the-key")
        browser.find_element(By.ID, "start").click()
        status = browser.find_element(By.ID, "status")
        _wait(lambda: "wrong reviewer key" in status.text, what="the error message")
        assert browser.find_element(By.ID, "login").is_displayed()
    finally:
        srv.stop()


def test_no_key_labels_an_item_the_page_does_not_show_and_a_failed_label_is_kept(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pngs: list[bytes], browser
) -> None:
    """Found by review (2026-11-29). (1) An item whose image could not be fetched was claimed
    but never drawn, and the next key press labelled it, unseen, with the previous item's image
    still on screen: now an item is shown (and keys act) only once drawn, and an item whose
    image is gone can only be skipped. (2) A label the server could not store (the store briefly
    down) was dropped and the page stopped: now the item stays shown and pressing again, once
    the store is back, records it."""
    import hashlib

    from selenium.webdriver.common.by import By

    work = tmp_path_factory.mktemp("review-page-faults")
    srv = start_in_process(work, tiny_model, review_queue="on", reviewer_key=KEY)
    try:
        ids = _queue(srv.url, pngs[30:33])
        sha = hashlib.sha256(pngs[31]).hexdigest()
        (work / "reviews" / "blobs" / sha[:2] / sha).unlink()  # the second item's image is gone

        browser.get(srv.url + "/review")
        browser.find_element(By.ID, "key").send_keys(KEY)
        browser.find_element(By.ID, "start").click()
        body = browser.find_element(By.TAG_NAME, "body")
        status = browser.find_element(By.ID, "status")
        _wait(lambda: body.get_attribute("data-review-id") == ids[0], what="the first item")
        body.send_keys("3")
        _wait(lambda: body.get_attribute("data-review-id") == ids[1], what="the imageless item")
        _wait(lambda: "no longer stored" in status.text, what="the missing image said")
        assert not browser.find_element(By.CSS_SELECTOR, "#classes button.label").is_enabled()
        body.send_keys("7")  # no label for an image nobody can see
        time.sleep(1.0)
        assert httpx.get(f"{srv.url}/v1/reviews/{ids[1]}", headers=H).json()["state"] == "pending"
        body.send_keys("s")  # it can be skipped
        _wait(lambda: body.get_attribute("data-review-id") == ids[2], what="the third item")
        assert httpx.get(f"{srv.url}/v1/reviews/{ids[1]}", headers=H).json()["state"] == "skipped"

        store = work / "reviews" / "reviews.sqlite3"
        aside = store.with_name("aside.sqlite3")
        store.rename(aside)  # the store is down
        body.send_keys("5")
        _wait(lambda: "not saved" in status.text, what="the failed label said")
        assert body.get_attribute("data-review-id") == ids[2]  # still shown, still claimed
        aside.rename(store)  # back
        _wait(lambda: httpx.get(srv.url + "/v1/reviews/stats", headers=H).status_code == 200,
              what="the store back", timeout=30)  # fmt: skip
        body.send_keys("5")  # pressed again: recorded
        _wait(lambda: browser.find_element(By.ID, "empty").is_displayed(), what="empty queue")
        item = httpx.get(f"{srv.url}/v1/reviews/{ids[2]}", headers=H).json()
        assert (item["state"], item["label"]) == ("reviewed", "5")
        assert httpx.get(f"{srv.url}/v1/reviews/{ids[0]}", headers=H).json()["label"] == "3"

        # (3) refused, not failed: the shown item was closed meanwhile (here skipped through
        # the API): a skip from the page is a 409 that pressing again cannot change, so the
        # page says so and moves on instead of asking to retry
        (late,) = _queue(srv.url, pngs[33:34])
        _wait(lambda: body.get_attribute("data-review-id") == late, what="the late item")
        r = httpx.post(
            f"{srv.url}/v1/reviews/{late}/skip", headers=H, json={"reviewer": "reviewer"}
        )
        assert r.status_code == 200, r.text
        body.send_keys("s")
        _wait(lambda: "already skipped" in status.text, what="the refusal said")
        assert "press again" not in status.text
        _wait(lambda: browser.find_element(By.ID, "empty").is_displayed(), what="moved on")
    finally:
        srv.stop()
