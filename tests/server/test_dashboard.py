"""The dashboard: /dashboard/data against /stats and the KV allocator, the admin gate, and the page itself in
Debian's headless chromium (Selenium) against a live `prefixrt serve`.

The browser test saves a screenshot under pytest's tmp path; with PREFIXRT_SCREENSHOT_DIR set it also writes
dashboard.png there (docs/dashboard.png was made that way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from prefixrt.server.dashboard import histogram_quantile

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = "/usr/bin/chromedriver"
SYSTEM = "You are a terse geography quiz assistant. Answer in one word. "
QUESTIONS = ["Capital of France?", "Capital of Peru?", "Capital of Japan?", "Capital of Kenya?"]


def test_histogram_quantile_exact():
    b = [(0.1, 2.0), (0.5, 6.0), (float("inf"), 8.0)]
    assert histogram_quantile(0.25, b) == pytest.approx(0.1)  # rank 2: the top of the first bucket
    assert histogram_quantile(0.5, b) == pytest.approx(0.3)  # rank 4: halfway through (0.1, 0.5]
    assert histogram_quantile(0.125, b) == pytest.approx(0.05)  # rank 1: halfway through (0, 0.1]
    assert histogram_quantile(0.99, b) == 0.5  # in the +inf bucket: the highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def _nodes(tree):
    for n in tree:
        if "head" in n:
            yield n
        yield from _nodes(n["children"])


def test_dashboard_data_and_admin_gate(tiny_checkpoints, tiny_tokenizer):
    """In process: the data's counters are /stats', the tree's tokens are the cache's (every used KV slot of an
    idle engine is cached), the tree's first node is the shared prefix, and the routes are admin routes."""
    from starlette.testclient import TestClient

    from prefixrt.server.app import create_app
    from tests.server.conftest import build_engine

    eng = build_engine(tiny_checkpoints, tiny_tokenizer, kv_cache_tokens=2048)
    try:
        open_app = TestClient(create_app(eng))
        for q in QUESTIONS:
            r = open_app.post("/v1/completions", json={"prompt": SYSTEM + q, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
        eng.wait_idle()
        d = open_app.get("/dashboard/data").json()
        stats = open_app.get("/stats").json()
        assert d["stats"] == stats and stats["requests_total"] == len(QUESTIONS)
        assert d["kv"]["used"] == stats["kv_total"] - stats["kv_free"]
        assert d["latency"]["ttft"]["total"]["count"] == len(QUESTIONS)
        assert d["latency"]["ttft"]["window"]["count"] == len(QUESTIONS)  # no sample 60 s old: since start
        assert d["finished"]["total"] == len(QUESTIONS) and d["finished"]["error_rate"] == 0.0
        assert d["history"] and d["history"][-1]["requests_total"] == len(QUESTIONS)
        full = eng.largest_prefixes(max_nodes=10_000)
        assert [ns["namespace"] for ns in full] == [None]
        assert full[0]["tokens"] == sum(n["tokens"] for n in _nodes(full)) == d["kv"]["used"]
        top = full[0]["children"][0]
        shared = eng.tokenizer.encode(SYSTEM)
        assert top["head"] == shared[: len(top["head"])] and top["tokens"] >= len(shared) - eng.page_size
        assert len(top["children"]) == len(QUESTIONS)  # one branch per question
        shown = d["prefixes"][0]["children"][0]
        assert shown["head"] == top["head"] and shown["preview"] == eng.tokenizer.decode(top["head"]) + "…"
        page = open_app.get("/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "<script src" not in page.text and "<link" not in page.text  # self-contained

        # Every series the Grafana dashboard queries is one /metrics exports.
        from prometheus_client.parser import text_string_to_metric_families

        exported = {x.name for fam in text_string_to_metric_families(open_app.get("/metrics").text)
                    for x in fam.samples}
        grafana = (Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text()
        queried = {m for p in json.loads(grafana)["panels"] for t in p["targets"]
                   for m in re.findall(r"prefixrt_\w+", t["expr"])}
        assert len(queried) >= 15 and queried <= exported, queried - exported

        keyed = TestClient(create_app(eng, admin_api_key="admin-key"))
        for path in ("/dashboard", "/dashboard/data"):
            assert keyed.get(path).status_code == 401
            assert keyed.get(path, headers={"Authorization": "Bearer admin-key"}).status_code == 200
    finally:
        eng.shutdown()


@pytest.mark.skipif(CHROMIUM is None or not os.path.exists(CHROMEDRIVER),
                    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
def test_dashboard_in_headless_chromium(server, tmp_path):
    """The page renders in a real browser and its numbers are /stats'."""
    pytest.importorskip("selenium", reason="selenium is in the dev extra: pip install -e '.[dev]'")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    for q in QUESTIONS:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": SYSTEM + q, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    stats = server.wait_idle()

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1400,1100", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.set_page_load_timeout(30)
        driver.get(server.url + "/dashboard")

        def shown(key):
            return driver.find_element(By.ID, key).get_attribute("data-value")

        # Rendered once the polled requests_total is the idle server's (a poll every 2 s).
        WebDriverWait(driver, 30).until(lambda d: shown("requests_total") == str(stats["requests_total"]))
        WebDriverWait(driver, 30).until(lambda d: int(d.find_element(By.TAG_NAME, "body")
                                                      .get_attribute("data-rendered") or 0) >= 3)  # a chart
        stats = server.stats()  # idle: nothing changes between this read and the page's last poll
        for key in ("requests_total", "cached_tokens_total", "prompt_tokens_total", "evicted_tokens_total",
                    "requests_waiting", "generated_tokens_total"):
            assert int(shown(key)) == stats[key], key
        assert float(shown("hit_rate")) == pytest.approx(stats["cache_hit_rate"], abs=1e-12)
        assert stats["cache_hit_rate"] > 0  # the shared prefix was reused
        assert int(shown("kv_used")) == stats["kv_total"] - stats["kv_free"]
        text = driver.find_element(By.ID, "hit_rate").text
        assert text.startswith(f"{100 * stats['cache_hit_rate']:.1f}%"), text
        nodes = driver.find_elements(By.CSS_SELECTOR, "#tree li.node")
        assert nodes and int(nodes[0].get_attribute("data-prefix-tokens")) > 0
        assert driver.find_element(By.ID, "lat_ttft").is_displayed()
        assert driver.find_elements(By.CSS_SELECTOR, "#hit_chart polyline")
        time.sleep(0.2)
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if os.environ.get("PREFIXRT_SCREENSHOT_DIR"):
            Path(os.environ["PREFIXRT_SCREENSHOT_DIR"]).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(os.environ["PREFIXRT_SCREENSHOT_DIR"]) / "dashboard.png")
    finally:
        driver.quit()
