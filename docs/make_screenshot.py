"""Make the pictures in ``docs/``: the HTML report of the bundled demo (the README's picture), the
report and the default Graphviz drawing of a 12-layer GPT-2 step, and a diff page.

    python docs/make_screenshot.py                     # all four, into docs/
    python docs/make_screenshot.py --only report --select gelu0 --out-dir /tmp

- ``report.png``: one step of ``tracer.demo`` (a two-block GPT with a custom autograd Function),
  a call selected through the search box so the details panel, its grad node and the dashed link
  between them show.
- ``gpt2-report.png``: a training step of a 12-layer GPT-2 (``transformers.GPT2Config`` at a small
  width, nothing downloaded) as the report first shows it.
- ``gpt2-dot.png``: ``gradtrace dot`` of that step with the default options, as a PNG.
- ``diff.png``: ``gradtrace diff --html`` of two such steps, one weight element perturbed by 3.1e-4.

The pages are opened in headless chromium (Debian's ``/usr/bin/chromium`` through Playwright); the
drawing and the diff page come from the command line, as a user makes them. Re-run it after
changing the report, the drawing or the diff page so the pictures stay current.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

import tracer
from export.html import html
from tracer.demo import build_demo, demo_step

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
HERE = os.path.dirname(os.path.abspath(__file__))
PICTURES = ("report", "gpt2-report", "gpt2-dot", "diff")


CLI = [sys.executable, "-c", "import sys; from export.cli import main; sys.exit(main())"]  # = gradtrace


def gradtrace(*argv: str, check: bool = True) -> None:
    """Run the command line as a user does."""
    subprocess.run([*CLI, *argv], check=check)


def gpt2_step(path: str, perturb: float = 0.0) -> None:
    """Trace one AdamW step of a 12-layer GPT-2 and save it to ``path``."""
    import transformers  # only this picture needs it

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=12, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    if perturb:
        with torch.no_grad():
            model.transformer.h[7].mlp.c_fc.weight[3, 5] += perturb
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 64))
    with tracer.trace(hash="md5") as t:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    t.save(path)


class Browser:
    def __init__(self, width: int, height: int) -> None:
        from playwright.sync_api import sync_playwright  # only for the pictures

        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        self.page = self._browser.new_page(viewport={"width": width, "height": height}, device_scale_factor=1)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)

    def open(self, path: str, ready: str) -> None:
        self.page.goto("file://" + path)
        self.page.wait_for_selector(ready)

    def shoot(self, out: str) -> None:
        self.page.mouse.move(1, 1)  # no hover highlight in the picture
        self.page.screenshot(path=out)
        print(f"wrote {out}")

    def close(self) -> None:
        self._browser.close()
        self._pw.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Make the pictures in docs/.")
    ap.add_argument("--out-dir", default=HERE)
    ap.add_argument("--only", choices=PICTURES, action="append", help="make only these (repeatable)")
    ap.add_argument("--select", default="gelu0", help="the demo call to select before its picture")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=960)
    args = ap.parse_args(argv)
    wanted = set(args.only or PICTURES)
    out = {name: os.path.join(args.out_dir, f"{name}.png") for name in PICTURES}

    with tempfile.TemporaryDirectory() as tmp:
        browser = Browser(args.width, args.height)
        try:
            if "report" in wanted:
                model, opt, batch = build_demo()
                with tracer.trace(hash="md5") as t:
                    demo_step(model, opt, batch)
                page_path = os.path.join(tmp, "demo.html")
                html(t, page_path)
                browser.open(page_path, "body[data-ready='1']")
                # select through the search box, as a user would: it unfolds, centres and links
                browser.page.click("#gt-search")
                browser.page.keyboard.type(args.select)
                browser.page.keyboard.press("Enter")
                browser.page.wait_for_selector("#gt-details h2")
                browser.shoot(out["report"])
            if wanted & {"gpt2-report", "gpt2-dot", "diff"}:
                step = os.path.join(tmp, "gpt2.gtrace")
                gpt2_step(step)
                if "gpt2-report" in wanted:
                    page_path = os.path.join(tmp, "gpt2.html")
                    gradtrace("report", step, "-o", page_path)
                    browser.open(page_path, "body[data-ready='1']")
                    browser.shoot(out["gpt2-report"])
                if "gpt2-dot" in wanted:
                    gradtrace("dot", step, "-o", out["gpt2-dot"], "--force")
                    print(f"wrote {out['gpt2-dot']}")
                if "diff" in wanted:
                    other = os.path.join(tmp, "gpt2-perturbed.gtrace")
                    gpt2_step(other, perturb=3.1e-4)
                    page_path = os.path.join(tmp, "diff.html")
                    gradtrace("diff", step, other, "--html", page_path, check=False)  # exit 1: they differ
                    browser.open(page_path, "body")
                    browser.shoot(out["diff"])
        finally:
            browser.close()
    if browser.errors:
        print(f"page errors: {browser.errors}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
