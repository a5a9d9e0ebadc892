"""A page of a report opened in a real browser (Playwright driving Debian's chromium), with the
page's errors collected: what the HTML tests share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"


@contextlib.contextmanager
def opened(path: Path) -> Iterator[tuple[Any, list[str]]]:
    """The page of ``path`` loaded in chromium, and the list its script errors and console
    errors are added to (skips where Playwright is missing)."""
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(path.as_uri())
            yield page, errors
        finally:
            browser.close()
