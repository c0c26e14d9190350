#!/usr/bin/env python3
"""Checks every quoted #include in kvlab's libraries against the layer table.

The table is the one in docs/architecture.md under "## The layer table": each row names a
unit, the files that belong to it (a folder ends with '/'; a file name may use shell
wildcards) and the units its files may include. A file belongs to the unit of its longest
matching pattern. A file may include files of its own unit and of the units its row lists,
nothing else: there is no transitive rule, so a row says exactly what its files may name.

usage: check_layers.py SOURCE_DIR
Exit status 0 when every include is allowed; 1, with one line per offending include, when
not; 2 when the table itself cannot be read.
"""
import fnmatch
import os
import re
import sys

# The folders whose sources make up the libraries and the CLI. Tests and benchmarks may reach
# into any layer (they test it); they are not checked.
CHECKED = ("autograd", "data", "nn", "checkpoints", "train", "infer", "apps")
SOURCE_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")
HEADING = "## The layer table"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def fail_table(message):
    print(f"check_layers: docs/architecture.md: {message}", file=sys.stderr)
    sys.exit(2)


def read_table(doc_path):
    """Returns [(unit, [pattern, ...], {allowed unit, ...})] from the layer table."""
    with open(doc_path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    try:
        start = lines.index(HEADING)
    except ValueError:
        fail_table(f"no '{HEADING}' section")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 3 or cells[0] in ("unit", "") or set(cells[0]) <= set("-: "):
            continue
        patterns = re.findall(r"`([^`]+)`", cells[1])
        allowed = set(cells[2].replace(",", " ").split())
        if not patterns:
            fail_table(f"unit '{cells[0]}' names no files")
        rows.append((cells[0], patterns, allowed))
    if not rows:
        fail_table(f"the '{HEADING}' section has no rows")
    units = {unit for unit, _, _ in rows}
    for unit, _, allowed in rows:
        unknown = allowed - units
        if unknown:
            fail_table(f"unit '{unit}' may include unknown units: {', '.join(sorted(unknown))}")
    return rows


def unit_of(path, rows):
    """The unit whose longest pattern matches `path` (relative, '/'-separated), or None."""
    best, best_len = None, -1
    for unit, patterns, _ in rows:
        for p in patterns:
            hit = path.startswith(p) if p.endswith("/") else fnmatch.fnmatchcase(path, p)
            if hit and len(p) > best_len:
                best, best_len = unit, len(p)
    return best


def main():
    if len(sys.argv) != 2:
        print("usage: check_layers.py SOURCE_DIR", file=sys.stderr)
        return 2
    root = sys.argv[1]
    rows = read_table(os.path.join(root, "docs", "architecture.md"))
    allowed = {unit: deps | {unit} for unit, _, deps in rows}
    problems, checked = [], 0
    for top in CHECKED:
        for folder, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                unit = unit_of(path, rows)
                if unit is None:
                    problems.append(f"{path}: in no unit of the layer table")
                    continue
                with open(os.path.join(root, path), encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        checked += 1
                        target = m.group(1)
                        if not os.path.isfile(os.path.join(root, target)):
                            problems.append(f"{path}:{number}: includes \"{target}\", which is "
                                            "not a path from the repository root")
                            continue
                        to = unit_of(target, rows)
                        if to is None:
                            problems.append(f"{path}:{number}: includes \"{target}\", which is "
                                            "in no unit of the layer table")
                        elif to not in allowed[unit]:
                            problems.append(f"{path}:{number}: {unit} may not include {to} "
                                            f"(\"{target}\")")
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} include(s) break the layer table "
              "(docs/architecture.md)")
        return 1
    print(f"check_layers: {checked} includes follow the layer table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
