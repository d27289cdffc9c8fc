"""What the CLI prints: strict JSON (a metric not measured yet is null, never NaN), and one line
naming the address and the fix when a server does not answer."""

from __future__ import annotations

import json
import subprocess
import sys

from adstream.commands import json_line


def test_json_lines_are_strict_json_with_null_for_an_unmeasured_metric():
    text = json_line({"progressive_auc": float("nan"), "runs": [{"ece": float("inf")}, 1.5], "steps": 3})
    assert json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) == {
        "progressive_auc": None,
        "runs": [{"ece": None}, 1.5],
        "steps": 3,
    }


def test_predict_without_a_server_is_one_line_naming_the_address_and_the_fix():
    done = subprocess.run(
        [sys.executable, "-m", "adstream.cli", "predict", "{}", "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "http://127.0.0.1:9" in lines[0] and "adstream serve" in lines[0], done.stderr
