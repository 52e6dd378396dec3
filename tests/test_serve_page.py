"""The live page at / in headless Chromium (Debian's `chromium`, driven by the Playwright wheel; Playwright's own
browser download is never used): it loads the served model, streams a prompt's denoising step by step (masked cells
as placeholders until revealed, block boundaries, one drawn frame per step event) and ends with exactly the text the
API returns for the same greedy request. With DLM_SERVE_PAGE_MODEL set to a trained masked run (e.g. the demo's
runs/demo/mdm), the same checks run on it and docs/serve-page.png is written from it mid-denoising."""

import os
import shutil
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright wheel is missing: pip install -e '.[dev]'")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from dlm.serve.engine import Engine  # noqa: E402
from tests.test_serve import QUESTION, build_models, client, running  # noqa: E402

CHROMIUM = shutil.which("chromium") or next((p for p in ("/usr/bin/chromium",) if Path(p).is_file()), None)
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "serve-page.png"
TRAINED = os.environ.get("DLM_SERVE_PAGE_MODEL")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium to drive: apt-get install -y chromium (Debian)"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def dirs(tiny_tokenizer, tmp_path_factory):
    return build_models(tiny_tokenizer, tmp_path_factory.mktemp("page"))


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1280, "height": 720})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('status').textContent === 'ready'", timeout=15000)
    return page, errors


def finish(page) -> dict:
    page.wait_for_function("['done', 'error'].includes(document.getElementById('status').textContent)",
                           timeout=30000)
    return {k: page.text_content(f"#{k}") for k in ("status", "steps", "nfe", "text", "error")}


@pytest.mark.parametrize("name", ["block", "simplex", "ar"])
def test_page_streams_the_denoising_and_ends_with_the_api_answer(browser, dirs, name, tmp_path):
    with running(Engine(dirs[name])) as url:
        page, errors = open_page(browser, url)
        page.fill("#prompt", QUESTION)
        page.fill("#max_tokens", "24")
        if name == "simplex":
            page.fill("#inference_steps", "8")
        page.fill("#delay", "120" if name == "block" else "0")
        if name == "block":  # the page enables only the options the chosen policy reads (the server refuses others)
            assert page.is_disabled("#confidence_threshold") and not page.is_disabled("#reveal_count")
            page.select_option("#policy", "threshold")
            assert page.is_disabled("#reveal_count") and not page.is_disabled("#confidence_threshold")
            page.select_option("#policy", "top_u")
        page.click("#run")
        if name == "block":  # mid-denoising: some cells revealed, the rest still placeholders, blocks marked
            page.wait_for_function("Number(document.getElementById('steps').textContent) >= 3")
            cells = page.locator("#canvas .cell")
            assert cells.count() == 24 and page.locator("#canvas .cell.block-start").count() == 5
            assert 0 < page.locator("#canvas .cell.masked").count() < 24
            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
            assert (tmp_path / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        shown = finish(page)
        extra = {"inference_steps": 8} if name == "simplex" else None
        api = client(url).chat.completions.create(model=name, messages=[{"role": "user", "content": QUESTION}],
                                                  max_tokens=24, seed=0, temperature=0, extra_body=extra)
        assert shown["status"] == "done" and not shown["error"] and not errors
        assert shown["text"] == api.choices[0].message.content
        assert shown["nfe"] == str(api.model_extra["nfe"][0])
        steps = int(shown["steps"])
        assert steps == (0 if name == "ar" else api.model_extra["nfe"][0]) and (name == "ar" or steps >= 3)
        if name == "simplex":
            assert page.text_content("#timestep") and page.locator("#canvas .cell.masked").count() == 0


def test_page_of_a_server_with_an_api_key_takes_the_key_from_the_url_fragment(browser, dirs):
    from tests.test_serve_limits import serving

    with serving(Engine(dirs["block"]), api_key="page-key") as url:
        page = browser.new_page()
        page.goto(url + "/")  # / is open, /v1 is not: the page says how to give the key
        page.wait_for_function("document.getElementById('status').textContent === 'error'", timeout=15000)
        assert "/#key=KEY" in page.text_content("#error")
        page.goto(url + "/#key=page-key")
        page.reload()
        page.wait_for_function("document.getElementById('status').textContent === 'ready'", timeout=15000)
        page.fill("#prompt", QUESTION)
        page.fill("#max_tokens", "12")
        page.fill("#delay", "0")
        page.click("#run")
        shown = finish(page)
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="page-key", max_retries=0, timeout=60)
        api = keyed.chat.completions.create(model="block", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=12, seed=0, temperature=0)
        assert shown["status"] == "done" and shown["text"] == api.choices[0].message.content


@pytest.mark.skipif(not TRAINED, reason="set DLM_SERVE_PAGE_MODEL to a trained masked run (e.g. runs/demo/mdm)")
def test_page_on_a_trained_model_writes_the_docs_screenshot(browser):
    question = "Ben has 10 peaches. Then Ben wins 3 peaches at a fair. After all this, how many peaches does Ben have?"
    with running(Engine(TRAINED)) as url:
        page, errors = open_page(browser, url)
        page.fill("#prompt", question)
        page.select_option("#policy", "top_u")
        page.fill("#reveal_count", "2")
        page.fill("#delay", "250")
        page.click("#run")
        page.wait_for_function("Number(document.getElementById('steps').textContent) >= 9")
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        shown = finish(page)
        name = client(url).models.list().data[0].id
        api = client(url).chat.completions.create(model=name, messages=[{"role": "user", "content": question}],
                                                  extra_body={"policy": "top_u", "u": 2})
        assert shown["status"] == "done" and not errors and shown["text"] == api.choices[0].message.content
        assert shown["steps"] == shown["nfe"] == str(api.model_extra["nfe"][0])
