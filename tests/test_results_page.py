"""The results page's one command: every row's command exists and takes the flags the page
gives it, so the page can be measured again as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.results_page import closing_table, rows

ROOT = Path(__file__).resolve().parents[1]
ROWS = rows("/tmp/gpt2-random", "/tmp/http-ckpt", "/work/.venvs")


@pytest.mark.parametrize("row", [r for r in ROWS if r.argv[0] == sys.executable], ids=lambda r: f"{r.area}/{r.name}")
def test_each_rows_command_takes_its_flags(row):
    module = row.argv[row.argv.index("-m") + 1]
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    flags = {arg.split("=")[0] for arg in row.argv if arg.startswith("--")}
    assert {f for f in flags if not re.search(rf"{re.escape(f)}\b", done.stdout)} == set()


def test_the_scripts_the_page_runs_are_in_the_tree():
    scripts = [r.argv[0] for r in ROWS if r.argv[0] != sys.executable]
    assert scripts and all((ROOT / s).is_file() for s in scripts)


def test_a_commands_closing_table_is_what_the_page_keeps():
    output = "loading\n| a | b |\n|---|---|\n| 1 | 2 |\nold\n| x | y |\n|---|---|\n| 3 | 4 |\nwrote bench.md\n"
    assert closing_table(output) == "| x | y |\n|---|---|\n| 3 | 4 |"
    assert closing_table("no table\nat all") == "no table\nat all"
