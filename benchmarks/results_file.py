"""Where each benchmark writes its result: benchmarks/results/<name>.json, with the run's
provenance (command, date, machine, software, commit), so a figure quoted in the README or
docs/performance.md carries its evidence. Imported by the benchmark scripts (run from the
repository root as `python benchmarks/<name>.py`)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def provenance() -> dict:
    """The command, UTC date, CPU, thread count, torch and deepfuse versions, and the git commit."""
    import torch

    import deepfuse

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        # changed code marks a run "+changes"; changed result files and prose do not
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                ":(top,exclude)benchmarks/results", ":(top,exclude)docs", ":(top,exclude)README.md"],
                               cwd=HERE, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return {"command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "deepfuse": deepfuse.__version__,
            "commit": commit + ("+changes" if dirty else ""),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def write_result(name: str, data: dict) -> str:
    """Writes data plus its provenance to benchmarks/results/<name>; returns the path."""
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", name)
    record = {"provenance": provenance(), **data}  # before the file is opened (and so changed)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path
