"""The web page at / in a real headless Chromium (tests/browser.py) against a real server
(api.server.Server under hypercorn on 127.0.0.1, in this process). The demo model's tokens follow
a script where a test needs to know what the model "wrote" (ScriptedCore, as in the tool-call
end-to-end tests), and each engine step is paced so that a stream takes long enough to watch.
Screenshots land in test-artifacts/ui/."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api.app import ServerConfig
from engine.core import EngineCore
from engine.front.async_engine import AsyncEngine
from scheduler.output import SchedulerOutput
from tests.api.test_tools_e2e import ENGINE, ScriptedCore
from tests.browser import by_testid, chromium, console_errors, screenshot, wait_for
from tests.server_utils import HTTP, InProcessServer, in_process_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may install chromium

STEP_DELAY_S = 0.03
API_KEY = "browser-test-key"
REPLY = (
    "Continuous batching packs every running request into one batch per step, so a new request "
    "joins at the next step instead of waiting for the others to finish."
)
MARKDOWN_REPLY = (
    "<think>\nThe user asks how to stream with the OpenAI SDK; a short example will do.\n</think>\n\n"
    "Use **stream=True** and read the deltas as they arrive:\n\n"
    '```python\nfor chunk in client.chat.completions.create(model="m", messages=msgs, stream=True):\n'
    '    print(chunk.choices[0].delta.content or "", end="")\n```\n\n'
    "- the first chunk carries the role\n- the last one carries `usage` when asked"
)
HOSTILE_LINE = (
    'Look: <script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> <b>bold?</b> '
    "[click](javascript:window.__pwned=3)"
)
HOSTILE_CODE = '<script>window.__pwned = 4</script><iframe src="/"></iframe>'
HOSTILE_REPLY = f"{HOSTILE_LINE}\n\n```html\n{HOSTILE_CODE}\n```"
# Records the length of the last reply's text at every DOM change, so that no intermediate
# length is missed between two polls of the test.
RECORD_LENGTHS = """
window.__lengths = [];
new MutationObserver(() => {
  const replies = document.querySelectorAll('[data-testid="chat-message-assistant"] .content');
  if (replies.length) window.__lengths.push(replies[replies.length - 1].textContent.length);
}).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
"""


SERIES_RGB = ([0x2F, 0x7D, 0x4F], [0xC9, 0x8A, 0x12], [0xB2, 0x3B, 0x3B])  # dashboard.js's p50, p90, p99
COUNT_PIXELS = """
const [id, rgb] = arguments;
const canvas = document.getElementById(id);
const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
let n = 0;
for (let i = 0; i < data.length; i += 4) {
  if (data[i + 3] > 200 && [0, 1, 2].every((c) => Math.abs(data[i + c] - rgb[c]) < 24)) n += 1;
}
return n;
"""


class PacedCore(ScriptedCore):
    """A ScriptedCore whose steps take at least STEP_DELAY_S, so that a stream can be watched."""

    def execute(self, out: SchedulerOutput) -> Any:
        time.sleep(STEP_DELAY_S)
        return super().execute(out)


@pytest.fixture(scope="module")
def core() -> PacedCore:
    return PacedCore(EngineCore(ENGINE))


@pytest.fixture(scope="module")
def server(core: PacedCore) -> Iterator[InProcessServer]:
    config = ServerConfig(engine=ENGINE, tool_parser="qwen3", reasoning_parser="qwen3")
    with in_process_server(config, loader=lambda _: AsyncEngine(core)) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


@pytest.fixture
def page(browser: Any, server: InProcessServer, core: PacedCore) -> Iterator[Any]:
    """The page on a fresh origin state: no stored conversations, settings or key."""
    core.clear()
    open_page(browser, server.url("/"))
    yield browser
    assert console_errors(browser) == []


def open_page(driver: Any, url: str) -> None:
    driver.get(url)
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(url)
    wait_for(lambda: by_testid(driver, "chat-input"), what="the chat input")


def send(driver: Any, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = by_testid(driver, "chat-input")[0]
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def last_reply(driver: Any) -> Any:
    return wait_for(lambda: by_testid(driver, "chat-message-assistant"), what="an assistant message")[-1]


def wait_done(driver: Any, timeout: float = 60.0) -> Any:
    return wait_for(
        lambda: (r := last_reply(driver)).get_attribute("data-done") == "true" and r, timeout, "the reply to end"
    )


def text_of(element: Any, selector: str) -> str:
    from selenium.webdriver.common.by import By

    return element.find_element(By.CSS_SELECTOR, selector).get_attribute("textContent")


def stats(server: InProcessServer) -> dict[str, Any]:
    response = HTTP.get(server.url("/stats"), timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def set_setting(driver: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def test_reply_grows_on_screen_token_by_token(page: Any, core: PacedCore) -> None:
    from selenium.webdriver.common.keys import Keys

    num_tokens = core.expect(REPLY)
    page.execute_script(RECORD_LENGTHS)
    box = by_testid(page, "chat-input")[0]
    box.send_keys("line one")
    box.send_keys(Keys.SHIFT, Keys.ENTER)  # a new line, not a send
    box.send_keys("line two")
    assert by_testid(page, "chat-message-user") == []
    box.send_keys(Keys.ENTER)

    reply = wait_done(page)
    assert [u.text for u in by_testid(page, "chat-message-user")] == ["line one\nline two"]
    assert text_of(reply, ".content") == REPLY
    lengths = page.execute_script("return window.__lengths")
    intermediate = sorted({n for n in lengths if 0 < n < len(REPLY)})
    assert len(intermediate) >= 5, f"the reply did not grow in steps: {lengths}"
    assert lengths == sorted(lengths), "the text on screen only grows"
    meta = text_of(reply, ".meta")
    # The count comes from the usage chunk (include_usage): the script's tokens, <|im_end|> included.
    assert re.fullmatch(rf"{num_tokens} tokens · [\d.]+ tok/s · first token \d+ ms", meta), meta
    screenshot(page, "reply-streamed")


def test_markdown_reasoning_and_code_render_as_elements(page: Any, core: PacedCore) -> None:
    from selenium.webdriver.common.by import By

    set_setting(page, "system-prompt", "You are a concise assistant for fp4serve users.")
    core.expect(MARKDOWN_REPLY)
    send(page, "How do I stream a chat completion with the OpenAI SDK?")
    reply = wait_done(page)
    reasoning = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.is_displayed() and reasoning.get_attribute("open") is None  # folded once the answer began
    body = reasoning.find_element(By.CSS_SELECTOR, ".reasoning-body")
    assert not body.is_displayed()
    reasoning.find_element(By.TAG_NAME, "summary").click()
    assert body.is_displayed() and "a short example will do" in body.text
    assert text_of(reply, ".content strong") == "stream=True"
    code = text_of(reply, ".content pre code")
    assert code.startswith("for chunk in client.chat.completions.create(") and code.endswith('end="")')
    assert [li.get_attribute("textContent") for li in reply.find_elements(By.CSS_SELECTOR, ".content ul li")] == [
        "the first chunk carries the role",
        "the last one carries usage when asked",
    ]
    assert text_of(reply, ".content li code") == "usage"
    wait_for(lambda: by_testid(page, "metric-generation-tokens")[0].text not in ("–", "0"), what="the dashboard")
    for chart in ("ttft-chart", "itl-chart"):  # the screenshot shows the charts with points
        wait_for(
            lambda: sum(page.execute_script(COUNT_PIXELS, chart, rgb) for rgb in SERIES_RGB) > 10,  # noqa: B023
            what=f"the {chart} lines",
        )
    screenshot(page, "chat-markdown")


def test_tool_calls_are_shown(page: Any, core: PacedCore) -> None:
    from selenium.webdriver.common.by import By

    set_setting(page, "tools", "[{not json")
    send(page, "Weather in Paris?")
    assert page.find_element(By.ID, "tools-error").text.startswith("Tools: not valid JSON")
    assert by_testid(page, "chat-message-user") == []  # nothing was sent
    page.find_element(By.ID, "tools").clear()
    page.find_element(By.ID, "tools-example").click()
    by_testid(page, "chat-input")[0].clear()
    core.expect('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>')
    send(page, "Weather in Paris?")
    reply = wait_done(page)
    calls = by_testid(reply, "tool-call")
    assert len(calls) == 1
    assert text_of(calls[0], ".tool-name") == "tool call: get_weather"
    assert text_of(calls[0], ".tool-args") == '{\n  "city": "Paris",\n  "days": 3\n}'
    assert "tool_calls" in text_of(reply, ".meta")


def test_model_reply_with_a_script_tag_is_shown_as_text(page: Any, core: PacedCore, server: InProcessServer) -> None:
    core.expect(HOSTILE_REPLY)
    send(page, "Say something dangerous")
    reply = wait_done(page)
    for attempt in ("live", "restored from localStorage"):
        assert text_of(reply, ".content p") == HOSTILE_LINE, attempt
        assert text_of(reply, ".content pre code") == HOSTILE_CODE, attempt
        counts = page.execute_script(
            "const m = document.getElementById('messages');"
            "return [m.querySelectorAll('script, img, b, iframe, a').length, window.__pwned === undefined];"
        )
        assert counts == [0, True], attempt
        # The conversation is kept in localStorage: a reload shows it again, rendered the same way.
        page.get(server.url("/"))
        reply = wait_done(page)
    assert [u.text for u in by_testid(page, "chat-message-user")] == ["Say something dangerous"]
    # The CSP's Trusted Types: the browser itself refuses any string written as HTML on this page.
    refused = page.execute_script(
        "try { document.createElement('div').innerHTML = '<b>x</b>'; return 'allowed'; } catch (e) { return e.name; }"
    )
    assert refused == "TypeError"
    assert ["TrustedHTML" in e["message"] for e in console_errors(page)] == [True]  # (reading drains the log)


def test_conversations_are_kept_in_local_storage_and_switched(page: Any, core: PacedCore) -> None:
    from selenium.webdriver.common.by import By

    core.expect("First answer.")
    send(page, "First question")
    wait_done(page)
    page.find_element(By.ID, "new-chat").click()
    assert by_testid(page, "chat-message-user") == []
    core.expect("Second answer.")
    send(page, "Second question")
    wait_done(page)
    titles = [b.text for b in page.find_elements(By.CSS_SELECTOR, "#conversations .open")]
    assert titles == ["Second question", "First question"]
    page.refresh()
    wait_for(lambda: by_testid(page, "chat-message-user"), what="the stored conversation")
    assert [u.text for u in by_testid(page, "chat-message-user")] == ["Second question"]
    page.find_elements(By.CSS_SELECTOR, "#conversations .open")[1].click()
    assert [u.text for u in by_testid(page, "chat-message-user")] == ["First question"]
    assert [text_of(r, ".content") for r in by_testid(page, "chat-message-assistant")] == ["First answer."]


def test_stop_aborts_the_request_and_the_server_shows_zero_running(page: Any, server: InProcessServer) -> None:
    set_setting(page, "max-tokens", "2000")  # the unscripted random model: it would run ~60 s
    send(page, "Write a very long story")
    wait_for(lambda: len(text_of(last_reply(page), ".content")) > 20, what="the first tokens")
    assert stats(server)["requests"]["running"] == 1
    wait_for(lambda: by_testid(page, "metric-running")[0].text == "1", what="the dashboard to show 1 running")
    by_testid(page, "chat-stop")[0].click()
    reply = wait_done(page, timeout=10)
    assert text_of(reply, ".meta").endswith("stopped")
    wait_for(lambda: stats(server)["requests"]["running"] == 0, what="the server to abort the request")
    assert stats(server)["kv_cache"]["usage"] == 0.0
    wait_for(lambda: by_testid(page, "metric-running")[0].text == "0", what="the dashboard to show 0")
    assert by_testid(page, "chat-send")[0].is_enabled() and not by_testid(page, "chat-stop")[0].is_enabled()
    screenshot(page, "stopped")


def test_dashboard_token_counter_rises_after_a_chat(page: Any, core: PacedCore, server: InProcessServer) -> None:
    counter = by_testid(page, "metric-generation-tokens")[0]
    before = int(wait_for(lambda: counter.text if counter.text.isdigit() else None, what="the token counter"))
    num_tokens = core.expect("Short answer.")
    send(page, "Hi")
    wait_done(page)
    wait_for(
        lambda: counter.text.isdigit() and int(counter.text) >= before + num_tokens,
        what=f"the counter to rise from {before} by {num_tokens}",
    )
    assert int(counter.text) == stats(server)["tokens"]["generation_total"]
    assert re.fullmatch(r"\d+\.\d%", by_testid(page, "metric-kv-usage")[0].text)
    assert by_testid(page, "metric-waiting")[0].text == "0"
    assert page.find_element("id", "info-device").text == "cpu"
    # the backend the engine chose on this CPU (the compiled paged ops where they build, else torch)
    assert page.find_element("id", "info-backend").text == HTTP.get(server.url("/health")).json()["attention_backend"]
    # The live charts drew the percentiles: pixels in a series' colour (p99 is drawn last, on top
    # of the others where they are equal, as they are with one request).
    for chart in ("ttft-chart", "itl-chart"):
        wait_for(
            lambda: sum(page.execute_script(COUNT_PIXELS, chart, rgb) for rgb in SERIES_RGB) > 10,  # noqa: B023
            what=f"the {chart} lines",
        )


USAGE_ROWS = """
return [...document.querySelectorAll('[data-testid="usage-by-key"] tbody tr')].map(
  (row) => [...row.children].map((cell) => cell.textContent));
"""


def usage_cells(driver: Any, key: str) -> list[str] | None:
    """The "Usage by key" row of `key` (requests, prompt, completion tokens, mean TTFT ms), or None.
    Read in one script: the dashboard replaces the rows every second."""
    return next((cells[1:] for cells in driver.execute_script(USAGE_ROWS) if cells[0] == key), None)


def test_usage_by_key_shows_the_keys_completion_tokens_rising_after_a_chat(
    page: Any, core: PacedCore, server: InProcessServer
) -> None:
    before = wait_for(lambda: usage_cells(page, "default"), what="the default key's usage row")
    num_tokens = core.expect("Short answer.")
    send(page, "Hi")
    wait_done(page)
    after = wait_for(
        lambda: (c := usage_cells(page, "default")) and int(c[2]) >= int(before[2]) + num_tokens and c,
        what=f"the key's completion tokens to rise from {before[2]} by {num_tokens}",
    )
    [served] = HTTP.get(server.url("/v1/usage"), timeout=5).json()["data"]
    assert after[:3] == [str(served["requests"]), str(served["prompt_tokens"]), str(served["completion_tokens"])]
    assert int(after[0]) == int(before[0]) + 1 and int(after[1]) > int(before[1])
    assert after[3] == str(round(served["mean_ttft_seconds"] * 1000))
    # Only the page's own key: a keyless server has just "default".
    assert [cells[0] for cells in page.execute_script(USAGE_ROWS)] == ["default"]


def test_with_an_api_key_the_page_works_only_once_the_key_is_entered(browser: Any, core: PacedCore) -> None:
    from selenium.webdriver.common.by import By

    config = ServerConfig(engine=ENGINE, api_key=API_KEY)
    with in_process_server(config, loader=lambda _: AsyncEngine(core)) as keyed:  # type: ignore[arg-type]
        core.clear()
        open_page(browser, keyed.url("/"))
        panel = browser.find_element(By.ID, "key-panel")
        wait_for(lambda: panel.is_displayed(), what="the key field")
        send(browser, "Hello?")
        refused = wait_done(browser)
        assert "missing API key" in text_of(refused, ".error")
        assert text_of(refused, ".content") == ""
        # The usage table asks /v1/usage with the page's key: refused without one, so no rows.
        wait_for(lambda: "Enter an API key" in browser.find_element(By.ID, "usage-hint").text, what="the usage hint")
        assert usage_cells(browser, "default") is None

        by_testid(browser, "api-key")[0].send_keys(API_KEY)
        by_testid(browser, "api-key-save")[0].click()
        wait_for(lambda: panel.get_attribute("data-state") == "ok", what="the key to be accepted")
        core.expect(REPLY)
        send(browser, "Hello again")
        reply = wait_done(browser)
        assert text_of(reply, ".content") == REPLY
        # With the key (the one --api-key, an admin named "default"), its own usage shows.
        wait_for(lambda: (c := usage_cells(browser, "default")) and int(c[0]) >= 1, what="the key's usage")
        assert not reply.find_element(By.CSS_SELECTOR, ".error").is_displayed()
        stored = browser.execute_script(
            "return [sessionStorage.getItem('fp4serve.apiKey'), JSON.stringify(localStorage)]"
        )
        assert stored[0] == API_KEY and API_KEY not in stored[1]
        screenshot(browser, "api-key")
        # The failed request logged a 401 in the console; nothing else may have.
        assert [e for e in console_errors(browser) if "401" not in e["message"]] == []


RENDER_MARKDOWN = """
const [texts, done] = [arguments[0], arguments[arguments.length - 1]];
import('/ui/markdown.js').then((md) => done(texts.map((text) => {
  const box = document.createElement('div');
  box.append(md.renderMarkdown(text));
  return box.innerHTML;  // reading is fine: only writing HTML strings is refused
})));
"""


@pytest.mark.parametrize(
    ("text", "html"),
    [
        (
            "**bold**, *it* and `a<b>`",
            '<p><strong>bold</strong>, <em>it</em> and <code class="inline">a&lt;b&gt;</code></p>',
        ),
        ("<script>alert(1)</script>\nline 2", "<p>&lt;script&gt;alert(1)&lt;/script&gt;<br>line 2</p>"),
        (
            "## Title\n1. one\n2. **two**",
            '<h4 class="md-heading">Title</h4><ol><li>one</li><li><strong>two</strong></li></ol>',
        ),
        (
            "> quoted\n\n- a\n  more\n- b\n\n---",
            "<blockquote><p>quoted</p></blockquote><ul><li>a<br>more</li><li>b</li></ul><hr>",
        ),
        ("[x](javascript:alert(1)) [y](/relative)", "<p>[x](javascript:alert(1)) [y](/relative)</p>"),
        (
            "[docs](https://example.org/a?b=1)",
            '<p><a href="https://example.org/a?b=1" target="_blank" rel="noopener noreferrer nofollow" '
            'title="https://example.org/a?b=1">docs</a></p>',
        ),
    ],
)
def test_markdown_renderer_builds_elements_and_escapes_everything_else(page: Any, text: str, html: str) -> None:
    assert page.execute_async_script(RENDER_MARKDOWN, [text]) == [html]


def test_a_code_block_still_streaming_renders_open(page: Any) -> None:
    [html] = page.execute_async_script(RENDER_MARKDOWN, ["Code:\n```python\nprint('<b>')"])
    assert html.startswith('<p>Code:</p><div class="code-block">')
    assert '<pre class="open"><code data-lang="python">print(\'&lt;b&gt;\')</code></pre>' in html
