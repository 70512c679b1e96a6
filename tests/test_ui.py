"""A sweep's parent run as a person sees it in MLflow's UI: headless Chromium, driven over the DevTools protocol.

The page must keep its About panel (with the child runs) on screen beside the sweep's table, and the table's links
must open on the address the UI is served from. Skipped, saying so, where no Chromium is installed
(``apt-get install chromium`` brings it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from helpers import LEAN, run_main
from servers import free_port, mlflow_server

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(BROWSER is None, reason="no Chromium here (apt-get install chromium)"),
]

# What the page shows, measured in the browser once the About panel has loaded.
PROBE = """
(() => {
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  let about = null, node;
  while ((node = walk.nextNode())) if (node.textContent.trim() === 'About this run') about = node.parentElement;
  if (!about) return null;
  const panel = about.parentElement.getBoundingClientRect();
  let box = about.parentElement.parentElement;  // the nearest scrolling container: what of the page shows
  while (box !== document.body && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
  const shown = box.getBoundingClientRect();
  const links = [...document.querySelectorAll('a[target=_blank]')]
    .map(a => [a.textContent, a.getAttribute('href'), a.href]);
  const children = [...document.querySelectorAll('a')].map(a => a.textContent).filter(t => t.includes('-mlp-digits-'));
  return {left: panel.left, right: panel.right, width: panel.width, shownLeft: shown.left, shownRight: shown.right,
          links, children};
})()
"""


@contextlib.contextmanager
def browser(width: int, height: int) -> Iterator[int]:
    """Headless Chromium with its DevTools port open; yields the port."""
    port = free_port()
    process = subprocess.Popen(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}",
         f"--window-size={width},{height}", "--user-data-dir=" + str(Path.cwd() / "chromium"), "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("Chromium did not open its DevTools port") from None
                time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


async def look(port: int, url: str, *, within_s: float = 60) -> dict[str, Any]:
    """Open ``url`` in a new tab and run ``PROBE`` until the page has its About panel (MLflow loads runs lazily)."""
    import aiohttp

    request = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?about:blank", method="PUT")
    with urllib.request.urlopen(request, timeout=10) as response:
        target = json.load(response)
    async with aiohttp.ClientSession() as session, session.ws_connect(target["webSocketDebuggerUrl"]) as ws:
        await ws.send_json({"id": 0, "method": "Page.navigate", "params": {"url": url}})  # the hash route intact
        while (await ws.receive_json()).get("id") != 0:
            pass
        deadline = time.monotonic() + within_s
        for number in range(1, 10_000):
            await ws.send_json({"id": number, "method": "Runtime.evaluate",
                                "params": {"expression": PROBE, "returnByValue": True}})  # fmt: skip
            while (reply := await ws.receive_json()).get("id") != number:
                pass
            value = reply["result"]["result"].get("value")
            if (value and value["children"]) or time.monotonic() > deadline:
                return value or {}
            await asyncio.sleep(0.5)
    return {}


def test_a_sweeps_parent_page_keeps_its_about_panel_and_child_runs_and_its_links_stay_on_the_ui(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with mlflow_server(tmp_path / "server") as server:
        # three axes make the parent's table wide; cheap ones (amp=true timed both formats, num_workers=1 spawned
        # a loader worker, in each of their jobs)
        axes = ["optimizer.lr=0.01,0.02", "trainer.log_every_n_steps=10,11", "trainer.seed=1,2"]
        sweep = ["-m", *axes, f"tracking.uri={server.uri}"]
        tiny = ["trainer.epochs=1", "trainer.max_steps=3", "device=cpu", "monitor.enabled=false", *LEAN]
        assert run_main(monkeypatch, *sweep, *tiny) == 0
        printed = capsys.readouterr().out
        assert "MLflow's compare page for these 8 runs: the link is in compare.md (" in printed  # too long to print
        assert f"All runs (model-training view): {server.uri}/#/experiments/1/runs?" in printed  # the server's
        client = MlflowClient(server.uri)
        (parent,) = [r for r in client.search_runs(["1"]) if r.data.tags.get("sweep.role") == "parent"]
        attached = Path(client.download_artifacts(parent.info.run_id, "compare/compare.md", str(tmp_path)))
        assert f"MLflow's compare page for these 8 runs: {server.uri}/#/compare-runs?runs=" in attached.read_text()
        page = f"{server.uri}/#/experiments/1/runs/{parent.info.run_id}?workflowType=machine_learning"
        with browser(1920, 1080) as port:
            seen = asyncio.run(look(port, page))
    assert seen, "the run page never showed its About panel"
    # on screen: inside what its scrolling container shows (a wide table once pushed it 3,000 px to the right)
    assert seen["shownLeft"] <= seen["left"] and seen["right"] <= seen["shownRight"] and seen["width"] >= 300
    assert len(seen["children"]) >= 8  # the child runs, listed in the panel (and in the table)
    links = {text: (href, resolved) for text, href, resolved in seen["links"]}
    compare = next(v for k, v in links.items() if k.startswith("MLflow's compare page"))
    assert compare[0].startswith("#/compare-runs?runs=")  # relative in the note...
    assert re.match(rf"{re.escape(server.uri)}/#/compare-runs\?runs=", compare[1])  # ...so it opens on this UI
