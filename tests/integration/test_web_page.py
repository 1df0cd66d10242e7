"""The browser chat page at ``/`` in a real headless Chromium (Debian's ``chromium`` and ``chromedriver``,
driven by Selenium) against a real 2-stage demo fleet: a streamed answer with its numbers, history that
survives a reload, Stop ending the generation on the fleet (its KV freed), the fleet panel, the sampling
the coordinator's /v1/models asks for, markdown (the page's ES module markdown.js on the vendored
markdown-it) and its escaping, export, the API-key prompt of a coordinator that requires a key, and tool
calls with their results (call blocks, results typed in the message box, an imported conversation)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import httpx
import pytest

from tests.conftest import start_coordinator, start_worker, wait_ready

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
KEY = "page-key-5d1e"
QUESTION = "What is the capital of France?"
# greedy without a penalty loops on this to any max_tokens (coordinator/chat/client.py): a long answer to stop
LONG = "Write a poem about the sea."

# the last assistant message: [state, text, rendered HTML, stats line]
LAST_ANSWER = """const m = [...document.querySelectorAll('.message.assistant')].pop();
return m ? [m.dataset.state, m.querySelector('.content').textContent, m.querySelector('.content').innerHTML,
            m.querySelector('.stats').textContent] : null;"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless Chromium for the module (each coordinator is its own origin, so its own localStorage)."""
    if not (CHROMIUM and CHROMEDRIVER):
        reason = ("Debian's chromium and chromium-driver are not installed (deploy/setup.sh installs them where "
                  "apt-get is usable)")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    downloads = tmp_path_factory.mktemp("downloads")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900",
                "--no-first-run", "--disable-background-networking", "--disable-sync", "--disable-extensions",
                "--disable-component-update", "--disable-default-apps", "--metrics-recording-only"):
        options.add_argument(arg)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads)})
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # a driver path given: Selenium Manager (which downloads drivers) is not run
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def fleet(build_2, tmp_path_factory):
    """Two workers (no mDNS) and two coordinators on them: one open, one requiring ``KEY``."""
    d = tmp_path_factory.mktemp("web")
    procs = []
    try:
        addresses = []
        for shard in range(2):
            proc, address = start_worker(build_2, shard, d, "--no-announce")
            procs.append(proc)
            addresses.append(address)
        peers = ["--no-discover", *(a for address in addresses for a in ("--peer", address))]
        (d / "open").mkdir()
        (d / "keyed").mkdir()
        (d / "keys").write_text(f"{KEY}\n")
        open_coordinator, url = start_coordinator(build_2, d / "open", *peers)
        procs.append(open_coordinator)
        keyed, keyed_url = start_coordinator(build_2, d / "keyed", *peers, "--api-key-file", str(d / "keys"))
        procs.append(keyed)
        wait_ready(url)
        wait_ready(keyed_url)
        yield {"url": url, "keyed_url": keyed_url, "coordinator": open_coordinator, "workers": addresses}
    finally:
        for proc in reversed(procs):
            proc.stop()


def wait_until(fn, timeout: float = 30.0, every: float = 0.05, what: str = "condition"):  # noqa: ANN001, ANN201
    """``fn()``'s first truthy value, polled; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := fn():
            return value
        time.sleep(every)
    pytest.fail(f"{what}: not seen after {timeout} s")


def open_page(browser, url: str) -> None:  # noqa: ANN001
    browser.get(url + "/")
    wait_until(lambda: browser.execute_script("return document.getElementById('model-name').textContent")
               not in ("", "…") or browser.execute_script("return document.getElementById('key-dialog').open"),
               what="the page's model name or its key prompt")


def ask(browser, text: str) -> None:  # noqa: ANN001
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "input").send_keys(text)
    browser.find_element(By.ID, "send").click()


def answered(browser, timeout: float = 60.0) -> list:  # noqa: ANN001
    """The last answer once it has stopped streaming."""
    return wait_until(lambda: (a := browser.execute_script(LAST_ANSWER)) and a[0] != "streaming" and a,
                      timeout=timeout, what="the answer to end")


def render(browser, text: str) -> str:  # noqa: ANN001
    """The page's markdown module's HTML of ``text``, in the page (newlines between tags dropped)."""
    html = browser.execute_async_script("""const [text, done] = arguments;
        import('/static/markdown.js').then((m) => done(m.renderMarkdown(text)), (e) => done('ERROR ' + e));""", text)
    return html.replace("\n", "")


def set_field(browser, element_id: str, value: str) -> None:  # noqa: ANN001
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, element_id)
    field.clear()
    if value:
        field.send_keys(value)


def test_answer_streams_with_its_numbers_and_survives_a_reload(browser, fleet):
    assert re.search(rf"chat page: {re.escape(fleet['url'])}/", fleet["coordinator"].text())
    open_page(browser, fleet["url"])
    ask(browser, QUESTION)
    state, text, _, stats = answered(browser)
    assert state == "done" and "Paris" in text, (state, text)
    assert re.search(r"TTFT \d+ ms · [\d.]+ tokens/s · \d+ tokens · prompt \d+", stats), stats
    first_completion, first_prompt = (int(n) for n in re.search(r"(\d+) tokens · prompt (\d+)", stats).groups())

    # the fleet panel (from /health): both stages, each with its healthy replica and its KV
    wait_until(lambda: len(browser.find_elements("css selector", "#fleet-stages .stage .replica .up")) == 2,
               what="two healthy replicas in the fleet panel")
    headings = [e.text for e in browser.find_elements("css selector", "#fleet-stages .stage .heading")]
    assert [h.split(" · ")[0] for h in headings] == ["stage 0", "stage 1"] and all("1 of 1" in h for h in headings)
    assert browser.find_element("id", "fleet-state").text == "ready"
    # the sampling sent is the coordinator's fallback from /v1/models (the page holds no copy of its own)
    fallback = httpx.get(fleet["url"] + "/v1/models", timeout=5).json()["data"][0].get("fallback_sampling") or {}
    hint = browser.find_element("id", "sampling-hint").text
    assert all(f"{k} {v:g}" in hint for k, v in fallback.items()) and (fallback or "Sends nothing" in hint), hint
    if shot := os.environ.get("FLEET_WEB_SCREENSHOT"):  # a PNG of the page after an answer, to look at
        browser.save_screenshot(shot)

    # a second turn carries the first (the history is sent): its prompt holds the first turn and its answer
    ask(browser, "And of Germany?")
    state, text, _, stats = answered(browser)
    assert state == "done" and "Berlin" in text, (state, text)
    assert int(re.search(r"prompt (\d+)", stats).group(1)) > first_prompt + first_completion

    browser.refresh()
    wait_until(lambda: len(browser.find_elements("css selector", "#messages .message")) == 4,
               what="4 messages after a reload")
    texts = [e.text for e in browser.find_elements("css selector", "#messages .message .content")]
    assert texts[0] == QUESTION and "Paris" in texts[1] and texts[2] == "And of Germany?" and "Berlin" in texts[3]
    assert "TTFT" in browser.find_elements("css selector", "#messages .message .stats")[-1].text
    titles = [e.text for e in browser.find_elements("css selector", "#conversation-list .open")]
    assert titles[0] == QUESTION

    # export: one JSON file with the conversation, its messages and their numbers
    browser.find_element("id", "export").click()
    exported = wait_until(lambda: [p for p in browser.downloads.glob("fleet-chats-*.json")], timeout=10,
                          what="the exported file")
    data = json.loads(exported[0].read_text())
    messages = data["conversations"][0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2 and "Paris" in messages[1]["content"]
    assert messages[1]["stats"]["completion_tokens"] == first_completion


def worker_sessions(url: str) -> tuple[int, list[int], int]:
    """(requests running, sessions on each worker, retained sessions of the prefix cache) from ``/health``."""
    health = httpx.get(f"{url}/health", timeout=5).json()
    retained = (health.get("prefix_cache") or {}).get("sessions", 0)
    return health["running"], [w["sessions"] for w in health["workers"]], retained


def test_stop_ends_the_generation_on_the_fleet(browser, fleet):
    url = fleet["url"]
    open_page(browser, url)
    browser.find_element("id", "new-chat").click()
    set_field(browser, "settings-temperature", "0")  # greedy, no penalty: the poem loops to max tokens
    set_field(browser, "settings-max-tokens", "4000")
    ask(browser, LONG)
    # the answer streams: text is on the page, and grows, while the fleet still generates it
    first = wait_until(lambda: (a := browser.execute_script(LAST_ANSWER)) and a[0] == "streaming" and len(a[1]) > 20
                       and a, timeout=30, what="streamed text")
    wait_until(lambda: len(browser.execute_script(LAST_ANSWER)[1]) > len(first[1]), what="the streamed text to grow")
    assert worker_sessions(url)[0] == 1
    browser.find_element("id", "stop").click()
    state, text, _, stats = answered(browser, timeout=5)
    # (the text as rendered: markdown-it ends each block with a newline, so the earlier text ends in one)
    assert state == "stopped" and text.startswith(first[1].rstrip()) and "stopped" in stats, (state, stats)
    stopped_at = int(re.search(r"~(\d+) tokens", stats).group(1))
    assert stopped_at < 1000
    fleet["coordinator"].wait_for(r": cancelled, prompt \d+ tokens", timeout=10)
    # every stage freed it: nothing runs, and the workers hold only what the prefix cache retains
    wait_until(lambda: (s := worker_sessions(url))[0] == 0 and all(n == s[2] for n in s[1]), timeout=10, every=0.2,
               what="the stopped answer's KV freed on every worker")
    retained = str(worker_sessions(url)[2])

    def panel_freed() -> bool:  # read in one script: the panel re-renders as it polls (a found element goes stale)
        summary, sessions = browser.execute_script(
            "return [document.getElementById('fleet-summary').textContent,"
            " Array.from(document.querySelectorAll('#fleet-stages .replica'), e => e.dataset.sessions)]")
        return "0 running" in summary and sessions == [retained, retained]

    wait_until(panel_freed, timeout=10, what="the fleet panel showing the stopped answer's KV freed")
    time.sleep(0.5)
    assert browser.execute_script(LAST_ANSWER)[1] == text  # nothing arrives after Stop
    browser.refresh()  # the partial answer is kept
    assert answered(browser)[1] == text
    set_field(browser, "settings-temperature", "")
    set_field(browser, "settings-max-tokens", "")


LINK = 'target="_blank" rel="noopener noreferrer"'
MARKDOWN = [
    ("**bold** *it* `a<b>` snake_case", "<p><strong>bold</strong> <em>it</em> <code>a&lt;b&gt;</code> snake_case</p>"),
    ("<img src=x onerror=alert(1)> & 'q'", "<p>&lt;img src=x onerror=alert(1)&gt; &amp; 'q'</p>"),
    ("- a\n- b\n  1. c", "<ul><li>a</li><li>b<ol><li>c</li></ol></li></ul>"),
    ("line\nnext\n\npara", "<p>line<br>next</p><p>para</p>"),
    ("[x](javascript:alert(1)) [y](https://a.org/b_c_d)",
     f'<p>[x](javascript:alert(1)) <a href="https://a.org/b_c_d" {LINK}>y</a></p>'),
    # what the first, hand-written renderer got wrong
    ("***x***", "<p><em><strong>x</strong></em></p>"),
    ("- one\n\n- two\n\n- three", "<ul><li><p>one</p></li><li><p>two</p></li><li><p>three</p></li></ul>"),
]


def test_markdown_is_rendered_and_escaped(browser, fleet):
    open_page(browser, fleet["url"])
    for source, html in MARKDOWN:
        assert render(browser, source) == html
    code = render(browser, "```python\nx = '<b>'\n```\nafter")
    assert '<pre><code class="language-python">x = \'&lt;b&gt;\'</code></pre>' in code and "Copy</button>" in code
    assert code.endswith("<p>after</p>")
    # a fenced block inside a list item stays a block in the item
    listed = render(browser, "1. Run:\n   ```bash\n   make\n   ```\n2. Done")
    assert listed.startswith('<ol><li>Run:<div class="code">') and '<code class="language-bash">make</code>' in listed
    # unclosed fence, as while an answer streams: still a code block
    unclosed = render(browser, "```\ndef f():")
    assert "<pre><code>def f():</code></pre>" in unclosed
    # the page's own headers: nothing inline may run even if escaping failed
    r = httpx.get(fleet["url"] + "/", timeout=5)
    assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_api_key_prompt_then_import(browser, fleet, tmp_path):
    url = fleet["keyed_url"]
    # the page and its files are open, the API is not
    assert httpx.get(url + "/", timeout=5).status_code == 200
    assert httpx.get(url + "/static/app.js", timeout=5).status_code == 200
    assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
    open_page(browser, url)
    assert browser.execute_script("return document.getElementById('key-dialog').open")
    set_field(browser, "key-input", "wrong-key")
    browser.find_element("id", "key-save").click()
    wait_until(lambda: browser.find_element("id", "key-error").text == "invalid API key", what="the refusal")
    set_field(browser, "key-input", KEY)
    browser.find_element("id", "key-save").click()
    wait_until(lambda: not browser.execute_script("return document.getElementById('key-dialog').open"),
               what="the key prompt to close")
    ask(browser, QUESTION)
    state, text, _, _ = answered(browser)
    assert state == "done" and "Paris" in text, (state, text)
    browser.refresh()  # the key is remembered
    open_page(browser, url)
    time.sleep(0.3)
    assert not browser.execute_script("return document.getElementById('key-dialog').open")

    # import: another browser's export adds its conversations (a file of anything else is refused, losing nothing)
    exported = tmp_path / "chats.json"
    exported.write_text(json.dumps({"format": "fleet-chat", "version": 1, "conversations": [
        {"id": "c-imported", "title": "From elsewhere", "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello **there**"}]}]}))
    (tmp_path / "bad.json").write_text('{"conversations": [{"messages": "no"}]}')
    browser.find_element("id", "import").send_keys(str(tmp_path / "bad.json"))
    wait_until(lambda: "not a fleet chat export" in browser.find_element("id", "banner").text, what="the refusal")
    browser.find_element("id", "import").send_keys(str(exported))
    wait_until(lambda: "Imported 1 conversation" in browser.find_element("id", "banner").text, what="the import")
    titles = [e.text for e in browser.find_elements("css selector", "#conversation-list .open")]
    assert titles == ["From elsewhere", QUESTION]
    browser.find_element("css selector", "#conversation-list .open").click()
    assert browser.execute_script(LAST_ANSWER)[2].strip() == "<p>Hello <strong>there</strong></p>"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
# the call blocks of the last answer: [data-call-id, name, id shown, arguments shown]
CALLS = """return [...[...document.querySelectorAll('.message.assistant')].pop().querySelectorAll('.tool-call')]
    .map((b) => [b.dataset.callId, b.querySelector('.tool-name').textContent, b.querySelector('.call-id').textContent,
                 b.querySelector('.tool-args').textContent]);"""


def choose_tools(browser, tools: str, choice: str) -> None:  # noqa: ANN001
    browser.execute_script("""const [tools, choice] = arguments;
        for (const [id, value] of [['settings-tools', tools], ['settings-tool-choice', choice]]) {
          const field = document.getElementById(id);
          field.value = value;
          field.dispatchEvent(new Event('input'));
        }""", tools, choice)


def test_tool_calls_and_results_in_the_conversation(browser, fleet, tmp_path):
    browser.get_log("browser")  # drained: the keyed coordinator's 401s of an earlier test are not this one's
    open_page(browser, fleet["url"])
    browser.find_element("id", "new-chat").click()
    choose_tools(browser, "[{", "")
    assert "not JSON" in browser.find_element("id", "tools-hint").text
    ask(browser, "What is the weather in Paris?")
    wait_until(lambda: "Not sent: tools: not JSON" in browser.find_element("id", "banner").text, what="the refusal")
    assert browser.find_element("id", "input").get_attribute("value") == "What is the weather in Paris?"  # kept
    set_field(browser, "input", "")
    set_field(browser, "settings-max-tokens", "32")  # a call is ~25 tokens
    choose_tools(browser, json.dumps([WEATHER]), "required")
    assert browser.find_element("id", "tools-hint").text == "Sends 1 tool(s): get_weather"
    ask(browser, "What is the weather in Paris?")
    state, text, _, _ = answered(browser)
    assert state == "done" and text == "", (state, text)
    calls = browser.execute_script(CALLS)
    assert calls, "no call block"
    for call_id, name, shown_id, arguments in calls:
        assert name == "get_weather" and shown_id == call_id and call_id.startswith("call_"), calls
        assert arguments == json.dumps(json.loads(arguments), indent=2) and "city" in json.loads(arguments)  # pretty
    assert f"Result of get_weather ({calls[0][0]})" in browser.find_element("id", "input").get_attribute("placeholder")

    # each result goes back as a tool message linked to its call; after the last one the model answers
    choose_tools(browser, json.dumps([WEATHER]), "none")
    set_field(browser, "settings-max-tokens", "8")
    for n, (call_id, *_) in enumerate(calls):
        ask(browser, f'{{"celsius": {21 + n}}}')
        wait_until(lambda: len(browser.find_elements("css selector", ".message.tool")) == n + 1, what="the result")
    state, text, _, _ = answered(browser)
    assert state == "done" and text.strip(), (state, text)
    results = browser.find_elements("css selector", ".message.tool")
    assert [r.find_element("css selector", ".call-link").text for r in results] == [c[0] for c in calls]
    assert results[0].find_element("css selector", ".tool-name").text == "get_weather"
    assert results[0].find_element("css selector", ".tool-result").text == '{\n  "celsius": 21\n}'
    assert browser.find_element("id", "input").get_attribute("placeholder") == "Message the fleet"

    # an imported conversation with calls and results shows them, model text as text
    hostile = '{"q": "<img src=x onerror=alert(1)>"}'
    (tmp_path / "tools.json").write_text(json.dumps({"format": "fleet-chat", "version": 1, "conversations": [
        {"id": "c-tools", "title": "Imported tools", "messages": [
            {"role": "user", "content": "look it up"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_z9", "type": "function", "function": {"name": "lookup", "arguments": hostile}}]},
            {"role": "tool", "tool_call_id": "call_z9", "content": "<b>found</b>"},
            {"role": "assistant", "content": "Found."}]}]}))
    browser.find_element("id", "import").send_keys(str(tmp_path / "tools.json"))
    wait_until(lambda: "Imported 1 conversation" in browser.find_element("id", "banner").text, what="the import")
    browser.find_element("css selector", "#conversation-list .open").click()
    assert browser.execute_script(CALLS) == []  # the last answer made no call; the one before did:
    blocks = browser.find_elements("css selector", ".tool-call .tool-args")
    assert [b.text for b in blocks] == [json.dumps(json.loads(hostile), indent=2)]
    assert browser.find_element("css selector", ".message.tool .tool-result").text == "<b>found</b>"
    assert not browser.execute_script("return document.querySelectorAll('#messages img, .tool-result b').length")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    choose_tools(browser, "", "")  # this origin's later tests send no tools
    set_field(browser, "settings-max-tokens", "")
