"""The README's pictures: a short local swarm photographed in headless Chromium.

``python -m echo.tools.screenshots`` starts a coordinator and three torch nodes
(:class:`~echo.tools.swarm.Swarm`; node 0 with its local page, ``--ui-port 0``), waits until
the job has trained ``--versions`` versions and node 0's credit is paid, and saves to ``--out``
(default docs/img/):

- ``dashboard-public.png``: the coordinator's page as anyone sees it, node 0 looked up;
- ``dashboard-operator.png``: the same page unlocked with the operator's token;
- ``node-page.png``: node 0's own page (``echo-node join --ui-port``).

Each PNG is reduced to a 256-colour palette, which keeps these flat pages sharp at a fraction of
the size. Needs chromium, chromedriver and selenium (:mod:`echo.tools.browser`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from echo.tools.browser import (
    BrowserMissing,
    PageTimeout,
    headless_chromium,
    missing,
    wait_for,
)
from echo.tools.swarm import Swarm, job_toml

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60.0


def wait(driver, what: str, predicate):
    return wait_for(driver, what, predicate, WAIT_S, poll_s=0.3)


def save(driver, path: Path) -> int:
    """Screenshot to ``path`` as a 256-colour PNG; returns its size in bytes."""
    from PIL import Image

    raw = path.with_suffix(".raw.png")
    driver.save_screenshot(str(raw))
    # The window is sized for the tallest view: cut the empty space below what is shown.
    bottom = driver.execute_script(
        "return Math.max(...[...document.body.children].filter(e => e.offsetParent !== null)"
        ".map(e => e.getBoundingClientRect().bottom)) * window.devicePixelRatio"
    )
    with Image.open(raw) as img:
        img = img.crop((0, 0, img.width, min(img.height, int(bottom) + 16)))
        img.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(
            path, optimize=True
        )
    raw.unlink()
    return path.stat().st_size


def shoot(base: str, token: str, node_id: str, node_page: str, out: Path) -> dict[str, int]:
    from selenium.webdriver.common.by import By

    sizes: dict[str, int] = {}
    driver = headless_chromium(1400, 2250)
    try:
        driver.get(f"{base}/#node={node_id}")
        wait(
            driver,
            "the leaderboard",
            lambda d: d.find_elements(By.CSS_SELECTOR, "#leaderboard tbody tr"),
        )
        driver.find_element(By.CSS_SELECTOR, "#node-form button").click()
        wait(
            driver,
            "the node's credit",
            lambda d: "Credit:" in d.find_element(By.ID, "my-node").text,
        )
        sizes["dashboard-public.png"] = save(driver, out / "dashboard-public.png")

        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
        wait(
            driver, "the node table", lambda d: d.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")
        )
        for chart in ("reward", "throughput", "staleness", "rejections"):
            wait(
                driver,
                f"the {chart} chart",
                lambda d, c=chart: d.find_elements(By.CSS_SELECTOR, f"#chart-{c} canvas"),
            )
        wait(driver, "the relay tree", lambda d: d.find_elements(By.CSS_SELECTOR, "#tree circle"))
        time.sleep(3)  # one more live tick, so the charts are drawn at their final size
        sizes["dashboard-operator.png"] = save(driver, out / "dashboard-operator.png")

        driver.set_window_size(1000, 760)
        driver.get(node_page)
        wait(
            driver,
            "the node's state",
            lambda d: (
                d.find_element(By.ID, "badge").text == "running"
                and "verified" in d.find_element(By.ID, "credit").text
            ),
        )
        sizes["node-page.png"] = save(driver, out / "node-page.png")
    finally:
        driver.quit()
    return sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--versions", type=int, default=20, help="trained versions before the shots")
    ap.add_argument("--nodes", type=int, default=3)
    args = ap.parse_args()
    # Before the swarm's minutes of training, not after them.
    reason = missing()
    if reason is not None:
        raise SystemExit(f"needs a browser: {reason}")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="echo-shots-") as tmp:
        swarm = Swarm(Path(tmp))
        try:
            info = swarm.start_coordinator()
            http = info["http"][0]
            job_id = swarm.submit(job_toml("demo", steps=args.versions + 40))
            for i in range(args.nodes):
                extra = ["--threads", "1", "--engine", "torch", "--api", http]
                swarm.start_node(f"node-{i}", extra + (["--ui-port", "0"] if i == 0 else []))
            state = Path(tmp) / "node-0" / "status.json"
            deadline = time.time() + 600
            while time.time() < deadline:
                st, _ = swarm.status(job_id)
                node = json.loads(state.read_text()) if state.exists() else {}
                if st["current_version"] >= args.versions and node.get("credit", {}).get("entries"):
                    break
                if st["status"] in ("failed", "cancelled"):
                    raise SystemExit(f"the job {st['status']}: {st.get('error')}")
                time.sleep(2)
            else:
                raise SystemExit("the swarm did not reach the version in 10 minutes")
            try:
                sizes = shoot(http, info["token"], node["node_id"], node["ui"], args.out)
            except (BrowserMissing, PageTimeout) as exc:
                raise SystemExit(str(exc)) from exc
        finally:
            swarm.stop()
    print(
        json.dumps(
            {
                "seconds": round(time.time() - t0),
                "version": st["current_version"],
                "bytes": sizes,
                "out": str(args.out),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
