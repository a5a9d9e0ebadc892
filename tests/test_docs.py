"""The documentation names things that exist: every dotted ``tracer.…``/``export.…`` name in the
README and docs/ resolves to a module or an attribute, and every repository path they cite is
there. (The CHANGELOG keeps the old names of what moved, on purpose.)"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "docs/api.md", "docs/trace-format.md", "docs/architecture.md", "benchmarks/README.md"]
DOTTED = re.compile(r"`((?:tracer|export)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
PATH = re.compile(r"`((?:tracer|export|benchmarks|scripts|docs|examples|tests)/[A-Za-z0-9_/.\-]+\.(?:py|md|html|sh))`")


def _resolve(name: str) -> Any:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def _mentions(pattern: re.Pattern[str]) -> list[tuple[str, int, str]]:
    found = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                found += [(doc, n, m.group(1)) for m in pattern.finditer(line)]
    return found


def test_the_docs_mention_dotted_names() -> None:
    assert len(_mentions(DOTTED)) > 20  # the pattern still finds what it checks


@pytest.mark.parametrize("doc,line,name", _mentions(DOTTED))
def test_dotted_names_in_the_docs_exist(doc: str, line: int, name: str) -> None:
    try:
        _resolve(name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{doc}:{line} names {name}, which does not exist ({exc})")


@pytest.mark.parametrize("doc,line,path", _mentions(PATH))
def test_paths_in_the_docs_exist(doc: str, line: int, path: str) -> None:
    assert os.path.exists(os.path.join(ROOT, path)), f"{doc}:{line} cites {path}, which is not in the repository"
