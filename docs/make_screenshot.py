"""Make ``docs/report.png``, the picture of the HTML report in the README, from the bundled demo.

    python docs/make_screenshot.py                      # -> docs/report.png
    python docs/make_screenshot.py --select gelu0 --out /tmp/report.png

It traces one step of ``tracer.demo`` (a two-block GPT with a custom autograd Function), writes
the report, opens it in headless chromium (Debian's ``/usr/bin/chromium`` through Playwright),
clicks a call so the details panel, its grad node and the dashed link between them show, and
saves the screenshot. Re-run it after changing the report so the picture stays current.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import tracer
from export.html import html
from tracer.demo import build_demo, demo_step

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Screenshot the HTML report of the demo step.")
    ap.add_argument("--out", default=os.path.join(HERE, "report.png"))
    ap.add_argument("--select", default="gelu0", help="the call to click before the screenshot")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=960)
    args = ap.parse_args(argv)

    from playwright.sync_api import sync_playwright

    model, opt, batch = build_demo()
    with tracer.trace(hash="md5") as t:
        demo_step(model, opt, batch)
    with tempfile.TemporaryDirectory() as tmp:
        page_path = os.path.join(tmp, "demo.html")
        html(t, page_path)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            page = browser.new_page(viewport={"width": args.width, "height": args.height}, device_scale_factor=1)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto("file://" + page_path)
            page.wait_for_selector("body[data-ready='1']")
            # select through the search box, as a user would: it unfolds, centres and links
            page.click("#gt-search")
            page.keyboard.type(args.select)
            page.keyboard.press("Enter")
            page.wait_for_selector("#gt-details h2")
            page.mouse.move(1, args.height - 1)   # no hover highlight in the picture
            page.screenshot(path=args.out)
            browser.close()
    if errors:
        print(f"page errors: {errors}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
