"""Flattens a ``.metal`` kernel and the headers it includes into one source.

Metal compiles kernels at run time from a single string
(``-[MTLDevice newLibraryWithSource:options:error:]`` has no include path), so
the build embeds each ``<op>.metal`` with its includes inlined. The emulator
(``custom_ops/emu/emu.py``) compiles the same flattened text, so what runs in
the tests is what the GPU gets.

Rules:
- ``#include "x.h"`` is searched next to the including file, then in the
  include directories; ``#include <x.h>`` only in the include directories.
  A quoted include that is found nowhere is an error; an angle include that is
  not ours (``<metal_stdlib>``, ``<math.h>``, ``<metal_emu.h>``) stays as it is:
  in Metal only ``<metal_*>`` resolve, the others sit in branches Metal skips.
- Each file is inlined once (our headers all have include guards).
- ``#line`` markers keep compiler messages pointing at the original files.

No dependencies beyond the standard library; usable as a script:
``python embed.py OUT_DIR [file.metal ...]`` writes ``<op>_metal_source.h``
headers defining ``static const char tfm_<op>_metal_source[]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

METAL_DIR = Path(__file__).resolve().parent
CUSTOM_OPS_DIR = METAL_DIR.parent
INCLUDE_DIR = CUSTOM_OPS_DIR / "include"

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*(?:"([^"\n]+)"|<([^>\n]+)>)[^\n]*$')
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once\b")
_RAW_DELIMITER = "tfm_src"
_CHUNK = 12000  # characters per raw string literal piece (compilers limit one literal's length)


class FlattenError(Exception):
    """An include could not be resolved."""


@dataclasses.dataclass(frozen=True)
class Flattened:
    """A flattened source and the files it was made of (the .metal first)."""

    source: str
    files: tuple


def default_include_dirs(metal_path) -> list:
    """Where a kernel's includes are searched: its own directory, then custom_ops/include."""
    return [Path(metal_path).resolve().parent, INCLUDE_DIR]


def _marker_name(path: Path, mode: str, root: Path) -> str:
    if mode == "absolute":
        name = str(path)
    else:
        try:
            name = os.path.relpath(path, root)
        except ValueError:
            name = path.name
    return name.replace("\\", "\\\\").replace('"', '\\"')


def flatten(metal_path, include_dirs=None, *, line_markers: str | None = "relative", root=None) -> Flattened:
    """Inlines the includes of ``metal_path``.

    Args:
        metal_path: the ``.metal`` (or any C++/MSL) file.
        include_dirs: searched after the including file's directory; default
            ``default_include_dirs(metal_path)``.
        line_markers: ``"relative"`` (names relative to ``root``, for the
            embedded source: no build paths in the binary), ``"absolute"``
            (for the emulator's compiler messages) or None.
        root: base of relative names; default ``custom_ops/``.

    Returns:
        Flattened(source, files).

    Raises:
        FlattenError: a quoted include was not found, or an include cycle.
    """
    metal_path = Path(metal_path).resolve()
    dirs = [Path(d).resolve() for d in (include_dirs if include_dirs is not None else default_include_dirs(metal_path))]
    root = Path(root).resolve() if root is not None else CUSTOM_OPS_DIR
    seen: set = set()
    files: list = []
    out: list = []

    def emit(path: Path, stack: tuple) -> None:
        seen.add(path)
        files.append(path)
        if line_markers:
            out.append(f'#line 1 "{_marker_name(path, line_markers, root)}"\n')
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        for number, line in enumerate(lines, start=1):
            if _PRAGMA_ONCE.match(line):
                out.append("\n")
                continue
            m = _INCLUDE.match(line)
            if not m:
                out.append(line if line.endswith("\n") else line + "\n")
                continue
            quoted, angled = m.group(1), m.group(2)
            name = quoted or angled
            candidates = ([path.parent] if quoted else []) + dirs
            found = next(((d / name).resolve() for d in candidates if (d / name).is_file()), None)
            if found is None:
                if quoted:
                    searched = ", ".join(str(d) for d in candidates)
                    raise FlattenError(f'{path}:{number}: cannot find include "{name}" (searched {searched})')
                out.append(line if line.endswith("\n") else line + "\n")  # <metal_stdlib>, <math.h>, ...
                continue
            if found in stack:
                chain = " -> ".join(str(p) for p in stack + (found,))
                raise FlattenError(f"{path}:{number}: include cycle: {chain}")
            if found not in seen:
                emit(found, stack + (found,))
                if line_markers:
                    out.append(f'#line {number + 1} "{_marker_name(path, line_markers, root)}"\n')
            else:
                out.append("\n")

    emit(metal_path, (metal_path,))
    return Flattened("".join(out), tuple(files))


def c_string_literal(source: str) -> str:
    """``source`` as adjacent C++ raw string literals (a C++11 expression)."""
    if f'){_RAW_DELIMITER}"' in source:
        raise ValueError(f"source contains the raw-string delimiter ){_RAW_DELIMITER}\"")
    pieces = [source[i:i + _CHUNK] for i in range(0, len(source), _CHUNK)] or [""]
    return "\n".join(f'R"{_RAW_DELIMITER}({p}){_RAW_DELIMITER}"' for p in pieces)


def symbol_for(metal_path) -> str:
    """The C symbol of an op's embedded source: ``tfm_<op>_metal_source``."""
    stem = re.sub(r"\W", "_", Path(metal_path).stem)
    return f"tfm_{stem}_metal_source"


def header_for(metal_path, include_dirs=None) -> str:
    """A C++ header defining the flattened source of ``metal_path`` as a string."""
    flat = flatten(metal_path, include_dirs, line_markers="relative")
    name = Path(metal_path).name
    symbol = symbol_for(metal_path)
    return (
        f"// Generated by custom_ops/metal/embed.py from {name}: do not edit.\n"
        f"#pragma once\n"
        f"// Library name for PipelineCache / <name>.metallib lookup.\n"
        f'static const char {symbol}_name[] = "{Path(metal_path).stem}";\n'
        f"static const char {symbol}[] =\n{c_string_literal(flat.source)};\n"
    )


def write_embedded_sources(out_dir, metal_files=None) -> list:
    """Writes ``<op>_metal_source.h`` for each .metal file into ``out_dir``.

    Files are rewritten only when their content changes (keeps builds incremental).
    Returns the header paths.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metal_files = sorted(METAL_DIR.glob("*.metal")) if metal_files is None else [Path(f) for f in metal_files]
    written = []
    for metal in metal_files:
        target = out_dir / f"{Path(metal).stem}_metal_source.h"
        text = header_for(metal)
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, target)
        written.append(target)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory for the generated <op>_metal_source.h headers")
    parser.add_argument("metal_files", nargs="*", help="default: every custom_ops/metal/*.metal")
    ns = parser.parse_args(argv)
    try:
        for path in write_embedded_sources(ns.out_dir, ns.metal_files or None):
            print(path)
    except FlattenError as e:
        print(f"embed.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
