#!/usr/bin/env python3
"""Checks every #include in kvlab's libraries against the layer table.

The table is the one in docs/architecture.md under "## The layer table": each row names a
unit, the files that belong to it (a folder ends with '/'; a file name may use shell
wildcards), the units its files may include and the third-party libraries whose headers they
may include. A file belongs to the unit of its longest matching pattern. A file may include
files of its own unit and of the units its row lists, nothing else: there is no transitive
rule, so a row says exactly what its files may name. Of the angle-bracket includes, those of
the libraries in THIRD_PARTY are checked against the row's last column; the standard library
and the header-only helpers (JSON, CLI11, cpp-httplib) are free to all.

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
CHECKED = ("platform", "autograd", "data", "nn", "checkpoints", "train", "infer", "report", "serve",
           "apps")
SOURCE_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")
HEADING = "## The layer table"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SYSTEM_INCLUDE = re.compile(r'^\s*#\s*include\s+<([^>]+)>')
# The third-party libraries a unit must be granted, by the headers that name them.
THIRD_PARTY = {
    "blas": re.compile(r"(cblas|openblas\w*|lapacke?)\.h$"),
    "openmp": re.compile(r"omp\.h$"),
    "hdf5": re.compile(r"(hdf5\w*|H5\w*)\.h$"),
    "mpi": re.compile(r"mpi\.h$"),
    "pcre2": re.compile(r"pcre2\.h$"),
    "nccl": re.compile(r"nccl\w*\.h$"),
    "cuda": re.compile(r"(cuda\w*|cublas\w*|cub/.*|thrust/.*|device_launch_parameters)\.h$|^cub/|^thrust/"),
}


def fail_table(message):
    print(f"check_layers: docs/architecture.md: {message}", file=sys.stderr)
    sys.exit(2)


def read_table(doc_path):
    """Returns [(unit, [pattern, ...], {allowed unit, ...}, {third-party library, ...})]."""
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
        if len(cells) != 4 or cells[0] in ("unit", "") or set(cells[0]) <= set("-: "):
            continue
        patterns = re.findall(r"`([^`]+)`", cells[1])
        allowed = set(cells[2].replace(",", " ").split())
        libraries = set(cells[3].replace(",", " ").split())
        if not patterns:
            fail_table(f"unit '{cells[0]}' names no files")
        unknown = libraries - set(THIRD_PARTY)
        if unknown:
            fail_table(f"unit '{cells[0]}' names unknown libraries: {', '.join(sorted(unknown))}")
        rows.append((cells[0], patterns, allowed, libraries))
    if not rows:
        fail_table(f"the '{HEADING}' section has no rows")
    units = {row[0] for row in rows}
    for unit, _, allowed, _ in rows:
        unknown = allowed - units
        if unknown:
            fail_table(f"unit '{unit}' may include unknown units: {', '.join(sorted(unknown))}")
    return rows


def unit_of(path, rows):
    """The unit whose longest pattern matches `path` (relative, '/'-separated), or None."""
    best, best_len = None, -1
    for unit, patterns, *_ in rows:
        for p in patterns:
            hit = path.startswith(p) if p.endswith("/") else fnmatch.fnmatchcase(path, p)
            if hit and len(p) > best_len:
                best, best_len = unit, len(p)
    return best


def check_file(root, path, unit, rows, allowed):
    """The problems of one source file's includes, and how many includes it has."""
    problems, checked = [], 0
    with open(os.path.join(root, path), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if m:
                checked += 1
                problems += check_quoted(root, f"{path}:{number}", unit, m.group(1), rows, allowed)
                continue
            m = SYSTEM_INCLUDE.match(line)
            if m:
                library = next((name for name, pattern in THIRD_PARTY.items()
                                if pattern.search(m.group(1))), None)
                if library is None:
                    continue
                checked += 1
                if library not in allowed[unit][1]:
                    problems.append(f"{path}:{number}: {unit} may not include {library}'s "
                                    f"<{m.group(1)}>")
    return problems, checked


def check_quoted(root, where, unit, target, rows, allowed):
    if not os.path.isfile(os.path.join(root, target)):
        return [f"{where}: includes \"{target}\", which is not a path from the repository root"]
    to = unit_of(target, rows)
    if to is None:
        return [f"{where}: includes \"{target}\", which is in no unit of the layer table"]
    if to not in allowed[unit][0]:
        return [f"{where}: {unit} may not include {to} (\"{target}\")"]
    return []


def main():
    if len(sys.argv) != 2:
        print("usage: check_layers.py SOURCE_DIR", file=sys.stderr)
        return 2
    root = sys.argv[1]
    rows = read_table(os.path.join(root, "docs", "architecture.md"))
    allowed = {unit: (deps | {unit}, libraries) for unit, _, deps, libraries in rows}
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
                found, n = check_file(root, path, unit, rows, allowed)
                problems += found
                checked += n
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
