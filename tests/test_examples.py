"""examples/convert_api.py runs end to end, writes outside the current directory, never overwrites.

Run on the tiny GGUF (a few seconds); the example itself prints the reloaded model's difference to the
converted one in memory, which a correct save and reload keeps at 0 (asserted below to < 1e-5, float32).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "convert_api.py"


def _run(*args, cwd, tmpdir):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_convert_api_example_writes_a_fresh_directory_and_refuses_an_existing_one(tiny_gguf, tmp_path):
    cwd, tmpdir = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmpdir.mkdir()
    done = _run(tiny_gguf, cwd=cwd, tmpdir=tmpdir)
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r"saved to (\S+); reloaded logits differ by (\S+)", done.stdout)
    assert match, done.stdout
    saved = Path(match.group(1))
    assert saved.is_relative_to(tmpdir) and (saved / "normswap.json").is_file()
    assert float(match.group(2)) < 1e-5
    assert list(cwd.iterdir()) == []  # nothing written where it ran

    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    refused = _run(tiny_gguf, existing, cwd=cwd, tmpdir=tmpdir)
    assert refused.returncode != 0 and "already exists" in refused.stderr
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
