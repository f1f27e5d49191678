"""Print the project's runtime requirements (base + the named extras) from pyproject.toml, one a line.

The images install these first, in their own layer, and the project itself (`--no-deps`) after, so a
change to the sources does not reinstall torch. Self-references such as `splitserve[worker]` are
expanded. Standard library only (Python >= 3.11).

    python requirements.py pyproject.toml [EXTRA ...] > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib

_SELF = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*\[([^\]]*)\]\s*$")


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    name = project["name"].lower()
    optional = project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"{pyproject}: no extra {extra!r} (have: {', '.join(sorted(optional))})")
        seen.add(extra)
        for req in optional[extra]:
            m = _SELF.match(req)
            if m and m.group(1).lower().replace("_", "-") == name:
                todo.extend(e.strip() for e in m.group(2).split(",") if e.strip())
            elif req not in out:
                out.append(req)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(requirements(argv[0], argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
