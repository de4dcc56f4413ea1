"""The results page's one command: every row's command exists and takes the flags the page
gives it, so the page can be measured again as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.results_page import closing_table, rows

ROOT = Path(__file__).resolve().parents[1]
ROWS = rows("/tmp/gpt2-random", "/tmp/http-ckpt", "/work/.venvs")


PYTHON_ROWS = [r for r in ROWS if r.argv[0] == sys.executable]

# Each module's `--help`, all in one process (each would import torch again on its own).
_HELPS = """
import contextlib, io, json, runpy, sys
helps = {}
for module in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [module, "--help"]
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    helps[module] = out.getvalue()
print(json.dumps(helps))
"""


def row_module(row) -> str:
    return row.argv[row.argv.index("-m") + 1]


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    modules = sorted({row_module(row) for row in PYTHON_ROWS})
    done = subprocess.run([sys.executable, "-c", _HELPS, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("row", PYTHON_ROWS, ids=lambda r: f"{r.area}/{r.name}")
def test_each_rows_command_takes_its_flags(row, helps):
    usage = helps[row_module(row)]
    assert "usage:" in usage
    flags = {arg.split("=")[0] for arg in row.argv if arg.startswith("--")}
    assert {f for f in flags if not re.search(rf"{re.escape(f)}\b", usage)} == set()


def test_the_scripts_the_page_runs_are_in_the_tree():
    scripts = [r.argv[0] for r in ROWS if r.argv[0] != sys.executable]
    assert scripts and all((ROOT / s).is_file() for s in scripts)


def test_a_commands_closing_table_is_what_the_page_keeps():
    output = "loading\n| a | b |\n|---|---|\n| 1 | 2 |\nold\n| x | y |\n|---|---|\n| 3 | 4 |\nwrote bench.md\n"
    assert closing_table(output) == "| x | y |\n|---|---|\n| 3 | 4 |"
    assert closing_table("no table\nat all") == "no table\nat all"
