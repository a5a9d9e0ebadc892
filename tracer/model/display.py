"""One display vocabulary: how names, shapes, dtypes, sizes and trace paths are written, by every
view of a trace (the summary, DOT, HTML, diff, the logs, ``show``, the memory tables).

Pure functions of strings and numbers: no torch, so a loaded trace renders without it. The HTML
report's JavaScript (export/assets/report.js) writes shapes and API names the same way.
"""

from __future__ import annotations

import math
import os
import re

# ---- APIs and modules ------------------------------------------------------------------------------
_API_PREFIXES = (("torch.nn.functional.", "F."), ("__main__.", ""))


def short_api(api: str) -> str:
    """``torch.nn.functional.linear`` -> ``F.linear``; a script's own ``__main__.MyFn.apply`` ->
    ``MyFn.apply``; anything else as it is."""
    for long, short in _API_PREFIXES:
        if api.startswith(long):
            return short + api[len(long):]
    return api


def function_label(api: str) -> str:
    """A custom Function's call by its class: ``mypkg.layers.MyFn.apply`` -> ``MyFn.apply``."""
    parts = api.split(".")
    return ".".join(parts[-2:]) if len(parts) > 2 else short_api(api)


def module_depth(path: str) -> int:
    """How deep a module path is: the root module ``""`` is 0, ``h.0.mlp`` is 3."""
    return 0 if not path else path.count(".") + 1


def within(path: str, prefix: str) -> bool:
    """Whether module ``path`` is ``prefix`` or lies below it (``""`` contains everything)."""
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def param_module(name: str) -> str:
    """The module path of a parameter or buffer name: ``0.l1.weight`` -> ``0.l1``."""
    return name.rpartition(".")[0]


# ---- phases ----------------------------------------------------------------------------------------
# The order a step runs its phases in, for every view that sorts or groups by phase; a phase
# a newer file names that this list does not know comes last, by name.
# A step's phases in the order it runs them: records.PHASES, which imports this module (so it is
# written out here; tests/test_phases.py checks they agree).
PHASE_ORDER = ("forward", "backward", "optimizer")


def phase_key(phase: str) -> tuple[int, str]:
    """Sort key of a ``Call.phase``: forward, backward, optimizer, then anything else by name."""
    try:
        return PHASE_ORDER.index(phase), ""
    except ValueError:
        return len(PHASE_ORDER), phase


# ---- tensors ----------------------------------------------------------------------------------------
_DTYPE_SHORT = {
    "float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "complex64": "c64", "complex128": "c128", "complex32": "c32", "bool": "bool",
}


def short_dtype(dtype: str) -> str:
    """``float32`` -> ``f32``, ``bfloat16`` -> ``bf16``; unknown dtypes as they are."""
    return _DTYPE_SHORT.get(dtype, dtype)


def shape_compact(shape: tuple[int, ...] | list[int]) -> str:
    """``[2,3,8]``: text, the summary and the logs (next to a short dtype: ``f32[2,3,8]``)."""
    return "[" + ",".join(str(s) for s in shape) + "]"


def shape_spaced(shape: tuple[int, ...] | list[int]) -> str:
    """``[2, 3, 8]``: DOT edge labels."""
    return "[" + ", ".join(str(s) for s in shape) + "]"


def shape_times(shape: tuple[int, ...] | list[int]) -> str:
    """``2×3×8``, ``scalar`` for a 0-d tensor: the HTML report."""
    return "×".join(str(s) for s in shape) if len(shape) else "scalar"


# ---- numbers ----------------------------------------------------------------------------------------
_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30


def format_bytes(n: int | None, exact: bool = False) -> str:
    """Memory in binary units: ``1.5 KiB``, ``-2.0 MiB`` (``exact``: ``2 MiB`` when whole);
    ``-`` for None."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", _GiB), ("MiB", _MiB), ("KiB", _KiB)):
        if n >= size:
            v = n / size
            return f"{sign}{v:.0f} {unit}" if exact and v == int(v) else f"{sign}{v:.1f} {unit}"
    return f"{sign}{n} B"


def format_size(n: int) -> str:
    """A file's size in decimal units: ``812 bytes``, ``14 kB``, ``3.2 MB``."""
    if abs(n) < 1000:
        return f"{n} bytes"
    if abs(n) < 1_000_000:
        return f"{n / 1000:.0f} kB"
    return f"{n / 1_000_000:.1f} MB"


def format_number(x: float | None, digits: int = 4) -> str:
    """A float in ``digits`` significant digits; ``-`` for None; ``inf``, ``-inf``, ``nan``."""
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def json_number(x: float | None) -> float | str | None:
    """A number for strict JSON: non-finite values as the strings ``nan``, ``inf``, ``-inf``."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 backward run``, ``2 backward runs``, ``1,024 calls``."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {nouns or noun + 's'}"


def plural_verb(n: int, noun: str, verb: str, verbs: str, nouns: str | None = None) -> str:
    """A count, its noun and a verb that agree: ``1 parameter differs``, ``2 parameters differ``
    (``verb`` for one, ``verbs`` for several: ``plural_verb(n, "call", "differs", "differ")``)."""
    return f"{plural(n, noun, nouns)} {verb if n == 1 else verbs}"


def all_finite(checked: int) -> str:
    """``all 412 checked tensors finite``; ``the 1 checked tensor finite``."""
    return f"the {plural(checked, 'checked tensor')} finite" if checked == 1 else f"all {plural(checked, 'checked tensor')} finite"


def clip(text: str, limit: int = 40) -> str:
    """One line of at most ``limit`` characters, whitespace runs collapsed, ``…`` if cut."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def args_pair(a: str, b: str) -> str:
    """``'3' vs '5'``: two calls' argument texts, each cut to a readable length; of keyword
    arguments both name the same (an optimizer step's settings), only those that differ:
    ``'lr=0.1' vs 'lr=0.2'``."""
    ka, kb = keyword_items(a), keyword_items(b)
    if ka is not None and kb is not None and ka.keys() == kb.keys():
        keys = [k for k in ka if ka[k] != kb[k]]
        if keys:
            return (f"{clip(', '.join(f'{k}={ka[k]}' for k in keys))!r} vs "
                    f"{clip(', '.join(f'{k}={kb[k]}' for k in keys))!r}")
    return f"{clip(a)!r} vs {clip(b)!r}"


def keyword_items(text: str) -> dict[str, str] | None:
    """``lr=0.1, betas=(0.9, 0.999)`` as ``{"lr": "0.1", "betas": "(0.9, 0.999)"}``; None when
    the text is not all ``name=value`` items or was cut short (ends with ``…``)."""
    if not text or text.endswith("…"):
        return None
    items: dict[str, str] = {}
    depth, start = 0, 0
    for i, ch in enumerate(text + ","):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            key, sep, value = text[start:i].strip().partition("=")
            if not sep or not key.replace(".", "").replace("_", "").isalnum():
                return None
            items[key] = value
            start = i + 1
    return items


# Characters of one free-text string of a trace (a source line, a module path, an args string) in
# a page: a real one is a few hundred at most; a file may hold one of megabytes.
LONG_TEXT_LIMIT = 2_000


def clip_long(text: str, limit: int = LONG_TEXT_LIMIT) -> str:
    """``text`` as it is up to ``limit`` characters; past it, its first ``limit`` characters, ``…``
    and how long it was: ``x = a+a+a…[3,000,004 characters]``. Unlike ``clip``, whitespace stays."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[{len(text):,} characters]"


# ---- trace files ------------------------------------------------------------------------------------
TRACE_SUFFIXES = (".gtrace.gz", ".gtrace", ".jsonl.gz", ".jsonl", ".json.gz", ".json")


def split_trace_suffix(path: str) -> tuple[str, str]:
    """``run.gtrace.gz`` -> (``run``, ``.gtrace.gz``); a name without a trace suffix keeps its
    own extension as the suffix (``run.txt`` -> (``run``, ``.txt``))."""
    for suffix in TRACE_SUFFIXES:
        if path.endswith(suffix) and len(path) > len(suffix):
            return path[: -len(suffix)], suffix
    stem, ext = os.path.splitext(path)
    return stem, ext


def with_tag(path: str, tag: str) -> str:
    """A sibling file named with a tag before the trace suffix: ``step.gtrace`` + ``rank0`` ->
    ``step.rank0.gtrace`` (one file per rank, per step)."""
    stem, suffix = split_trace_suffix(path)
    return f"{stem}.{tag}{suffix}"


def sibling(path: str, ext: str) -> str:
    """The file a view of a trace goes to by default: ``step.gtrace.gz`` + ``.html`` ->
    ``step.html``."""
    return split_trace_suffix(path)[0] + ext


# ---- inert text ----------------------------------------------------------------------------------------
# What a terminal acts on or a reader is misled by, shown as an escape instead: C0/C1 control
# characters (ESC starts the sequences that clear a screen or set a window title; a newline
# would forge an output line), the Unicode line separators, every format character (category
# Cf: the bidirectional overrides that reorder what is shown, zero-width spaces and joiners,
# U+FEFF, U+061C, the TAG characters U+E0000-E007F) and the other characters Unicode draws as
# nothing (Default_Ignorable_Code_Point: variation selectors, Hangul fillers), so that
# ``lin\u200bear0`` never reads as ``linear0``; and lone surrogates (not text at all).
# Inclusive ranges of code points, shared by the terminal (``inert``) and the HTML pages
# (``UNSAFE_JS``, which their scripts apply to every string they show).
UNSAFE_RANGES: tuple[tuple[int, int], ...] = (
    (0x0000, 0x001F), (0x007F, 0x009F), (0x00AD, 0x00AD), (0x034F, 0x034F), (0x0600, 0x0605),
    (0x061C, 0x061C), (0x06DD, 0x06DD), (0x070F, 0x070F), (0x0890, 0x0891), (0x08E2, 0x08E2),
    (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x2028, 0x202E),
    (0x2060, 0x206F), (0x3164, 0x3164), (0xD800, 0xDFFF), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0), (0xFFF0, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)


def _char_class(ranges: tuple[tuple[int, int], ...], js: bool = False) -> str:
    """A regular expression's character class of ``ranges`` (``js``: JavaScript's ``\\u{...}``
    spelling, for a ``u``-flag RegExp)."""
    def one(c: int) -> str:
        return f"\\u{{{c:x}}}" if js else f"\\U{c:08x}"
    return "[" + "".join(one(a) if a == b else f"{one(a)}-{one(b)}" for a, b in ranges) + "]"


_UNSAFE = re.compile(_char_class(UNSAFE_RANGES))
_UNSAFE_BUT_NEWLINE = re.compile(_char_class(((0x00, 0x09), (0x0B, 0x1F), *UNSAFE_RANGES[1:])))
UNSAFE_JS = _char_class(UNSAFE_RANGES, js=True)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    ch = m.group()
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def inert(text: str) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``, ``\\n``): a string
    from a trace file, safe to print on one line of a terminal."""
    return _UNSAFE.sub(_escape, text)


def inert_lines(text: str) -> str:
    """``inert`` but for the newlines, which stay: text that gradtrace laid out in lines."""
    return _UNSAFE_BUT_NEWLINE.sub(_escape, text)
