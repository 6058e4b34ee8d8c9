"""The chat page of `swarm api` (swarm/api/chat.html) in headless Chromium (Debian's `chromium`, driven by Playwright):
type the API key, pick smollm2-135m, send a prompt, watch the answer stream in token by token, see its route over
both peers and its latency; then stop a second answer midway. The screenshot is kept as .cache/artifacts/chat-page.png.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from ..shared_swarm import RunningSwarm
from .conftest import API_KEY, ARTIFACTS, ORPHAN_MODEL, RunningApi

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MODEL = "smollm2-135m"
ANSWER_TOKENS = 24  # about 3 s at the ~8 tokens/s of two CPU peers
ANSWER_TIMEOUT_MS = 120_000

# Records the length of the last answer's text at every change of the conversation, to see it grow.
WATCH_THE_ANSWER = """() => {
  window.answerLengths = [];
  new MutationObserver(() => {
    const texts = document.querySelectorAll('[data-role="assistant"] [data-testid="answer-text"]');
    const length = texts.length ? texts[texts.length - 1].textContent.length : 0;
    if (length !== window.answerLengths.at(-1)) window.answerLengths.push(length);
  }).observe(document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
}"""

pytestmark = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason="chromium is not installed (make test)")


@pytest.fixture
def page() -> Iterator[Page]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 820})
            page.set_default_timeout(30_000)
            yield page
        finally:
            browser.close()


def test_a_prompt_streams_into_the_page(page: Page, running_api: RunningApi, running_swarm: RunningSwarm) -> None:
    page.goto(running_api.base_url + "/")
    # Without its key the server lists no model, and the page says why in the API's words.
    expect(page.get_by_test_id("error")).to_contain_text("no API key")
    expect(page.get_by_test_id("send")).to_be_disabled()
    page.get_by_test_id("api-key").fill(API_KEY)
    page.get_by_test_id("api-key").press("Tab")
    expect(page.locator("#model option")).to_have_count(len(running_api.models))
    expect(page.get_by_test_id("error")).to_be_hidden()
    page.get_by_test_id("model").select_option(MODEL)
    page.get_by_test_id("max-tokens").fill(str(ANSWER_TOKENS))
    page.get_by_test_id("temperature").fill("0")

    page.evaluate(WATCH_THE_ANSWER)
    page.get_by_test_id("prompt").fill("Tell me about the sea.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.get_by_test_id("prompt").press("Enter")
    assert sent.value.post_data_json["messages"] == [{"role": "user", "content": "Tell me about the sea."}]
    answer = page.locator('[data-role="assistant"]').last
    expect(answer).to_have_attribute("data-status", "done", timeout=ANSWER_TIMEOUT_MS)

    text = answer.get_by_test_id("answer-text").inner_text()
    lengths = [length for length in page.evaluate("window.answerLengths") if length]
    assert len(lengths) >= 3 and lengths == sorted(lengths) and lengths[-1] == len(text), lengths
    assert int(answer.get_attribute("data-chunks")) >= 3
    hops = page.get_by_test_id("route-hop")
    spans = [(hop.get_attribute("data-start"), hop.get_attribute("data-end")) for hop in hops.all()]
    assert spans == [("0", "15"), ("15", "30")]
    assert sorted(hop.get_attribute("data-peer-id") for hop in hops.all()) == sorted(running_swarm.peer_ids)
    expect(hops.first).to_contain_text("blocks 0–15 on peer")
    for field in ("ttft", "token-p50", "token-p95"):
        expect(page.get_by_test_id(field)).to_have_text(re.compile(r"^\d+(\.\d)? ms$"))
    expect(page.get_by_test_id("tokens-per-s")).to_have_text(re.compile(r"^\d+\.\d$"))
    expect(page.get_by_test_id("server-token-ms")).to_have_text(re.compile(r" ms / .* ms$"))
    expect(page.get_by_test_id("usage")).to_have_text(re.compile(r"^\d+ / \d+$"))

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = ARTIFACTS / "chat-page.png"
    screenshot.unlink(missing_ok=True)
    page.screenshot(path=str(screenshot))
    assert screenshot.stat().st_size > 10_000  # a rendered page, not a blank one

    # A second turn sends the whole conversation; Stop ends its answer midway and keeps what arrived.
    page.get_by_test_id("max-tokens").fill("200")
    page.get_by_test_id("prompt").fill("Say more.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.get_by_test_id("send").click()
    assert [message["role"] for message in sent.value.post_data_json["messages"]] == ["user", "assistant", "user"]
    assert sent.value.post_data_json["messages"][1]["content"] == text
    second = page.locator('[data-role="assistant"]').last
    expect(second.get_by_test_id("answer-text")).not_to_be_empty(timeout=ANSWER_TIMEOUT_MS)
    page.get_by_test_id("stop").click()
    expect(second).to_have_attribute("data-status", "stopped")
    expect(second.get_by_test_id("answer-meta")).to_contain_text("stopped")
    expect(page.get_by_test_id("send")).to_be_enabled()
    expect(page.locator("body")).to_have_attribute("data-state", "idle")

    # JSON mode: the request asks for a JSON object, and the answer is one (constrained decoding).
    page.get_by_test_id("new-chat").click()
    page.get_by_test_id("json-mode").check()
    page.get_by_test_id("max-tokens").fill("48")
    page.get_by_test_id("prompt").fill("Describe the sea as JSON.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.get_by_test_id("send").click()
    assert sent.value.post_data_json["response_format"] == {"type": "json_object"}
    shaped = page.locator('[data-role="assistant"]').last
    expect(shaped).to_have_attribute("data-status", "done", timeout=ANSWER_TIMEOUT_MS)
    assert shaped.get_by_test_id("answer-text").inner_text().startswith("{")  # whole when it ended before 48 tokens
    page.get_by_test_id("json-mode").uncheck()

    # A model whose blocks no peer serves: the API's 503 shows as the error, and the turn is taken back.
    page.get_by_test_id("model").select_option(ORPHAN_MODEL)
    page.get_by_test_id("prompt").fill("Anyone there?")
    page.get_by_test_id("send").click()
    expect(page.get_by_test_id("error")).to_contain_text("503", timeout=ANSWER_TIMEOUT_MS)
    expect(page.get_by_test_id("prompt")).to_have_value("Anyone there?")
    expect(page.get_by_test_id("message")).to_have_count(2)
