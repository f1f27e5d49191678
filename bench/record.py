"""Writes a benchmark's results as JSON plus a markdown table, with the command, commit, GPU and date."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def environment() -> dict:
    # SPLITSERVE_COMMIT wins: where the tree travels to another machine, its .git may be an old copy
    commit = os.environ.get("SPLITSERVE_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=False).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    gpu = "none"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except ImportError:
        pass
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit, "gpu": gpu,
            "cpu": platform.processor() or platform.machine(),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def record(path: str | Path, name: str, params: dict, rows: list[dict]) -> dict:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, **environment(), "params": params, "results": rows}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    env = {k: doc[k] for k in ("command", "commit", "gpu", "date")}
    md = f"# {name}\n\n" + "\n".join(f"- {k}: `{v}`" for k, v in env.items()) + "\n\n" + markdown_table(rows) + "\n"
    path.with_suffix(".md").write_text(md)
    print(markdown_table(rows))
    return doc
