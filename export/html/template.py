"""One templating style for every page gradtrace writes (the report, the diff view, the ranks page).

A page is a template, package data under ``export/html/templates/``, whose ``${name}`` fields
``fill`` replaces (``string.Template``: one pass, so what goes in is never read as a field, and
CSS/JS need no escaping). The pages' CSS and JavaScript are files under ``export/assets/``,
inlined by ``style``/``script`` so that a page opens from ``file://`` with no network and nothing
inlined can close its element. Data travels as JSON inside ``<script type="application/json">``,
written by ``json_for_script``; the pages put strings into the document only as text.
"""

from __future__ import annotations

import functools
import json
import re
import string
from pathlib import Path
from typing import Any

# Read beside this package: works installed, editable, and while ``export`` is a namespace package.
_TEMPLATES = Path(__file__).resolve().parent / "templates"
_ASSETS = Path(__file__).resolve().parent.parent / "assets"

_SOURCE_MAP = re.compile(r"^//# sourceMappingURL=.*$", re.MULTILINE)
_SCRIPT_END = re.compile(r"</(script)", re.IGNORECASE)


def asset(name: str) -> str:
    """The text of a file under ``export/assets/`` (``report.js``, ``vendor/dagre.min.js``)."""
    return (_ASSETS / name).read_text(encoding="utf-8")


@functools.cache
def script(*names: str) -> str:
    """Assets as the body of an inline ``<script>``: no source-map look-ups (they would be a
    request) and no way to close the script element."""
    code = "\n".join(asset(n) for n in names)
    return _SCRIPT_END.sub(r"<\\/\1", _SOURCE_MAP.sub("", code))


@functools.cache
def style(*names: str) -> str:
    """Assets as the body of an inline ``<style>`` (one after the other, a newline between)."""
    return "\n".join(asset(n) for n in names).replace("</", "<\\/")


def json_for_script(data: Any, *, sort_keys: bool = False) -> str:
    """JSON text safe inside ``<script type="application/json">`` (and as a JS literal): no
    ``<``, ``>`` or ``&`` can end or alter the element, and U+2028/2029 stay escaped."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False, sort_keys=sort_keys)
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


@functools.cache
def _template(name: str) -> string.Template:
    return string.Template((_TEMPLATES / name).read_text(encoding="utf-8"))


def fill(name: str, **fields: str) -> str:
    """The page ``templates/<name>`` with each ``${field}`` replaced; every field is required.
    The values go in as they are: escape text for HTML (``html.escape``) before passing it."""
    return _template(name).substitute(fields)


__all__ = ["asset", "fill", "json_for_script", "script", "style"]
