"""Recipe: a week of traffic from six pods: did the prompt change pay? (docs/recipes.md)

Six pods each write their own record files (lines made by ``record_line`` from a real timeline and summary),
hour by hour in the dataset's layout, each closed hour
compressed to ``.jsonl.gz`` (one pod caught between writing the ``.gz`` and removing its ``.jsonl``).
``llmtap compare DIR`` then reads the whole directory through the command line and gives the verdict.
"""

from __future__ import annotations

import gzip
import json
import random
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmtap.analysis.summary import summarize
from llmtap.telemetry import identity
from llmtap.telemetry.records.record import record_line
from tests.conftest import PATIENCE
from tests.telemetry.test_recorder import timeline

ROOT = Path(__file__).resolve().parents[2]
WEEK_START = datetime(2026, 11, 23, tzinfo=UTC).timestamp()
PODS = 6


def template() -> dict[str, Any]:
    """One real record line: what the telemetry process writes for a streamed chat request."""
    tl = timeline()
    tl.route, tl.prompt_version = "support", "v1"
    return record_line(tl, summarize(tl), None, identity.current())


def week_of_records(root: Path) -> int:
    """Six pods, seven days, a few requests an hour at four hours a day; v2 (cache-friendly) from Thursday."""
    rng = random.Random(27)
    base = template()
    written = 0
    for day in range(7):
        for hour in (3, 9, 15, 21):
            start = WEEK_START + day * 86400 + hour * 3600
            moment = datetime.fromtimestamp(start, UTC)
            part = root / f"date={moment:%Y-%m-%d}" / f"hour={moment:%H}"
            for pod in range(PODS):
                path = part / f"llmtap-{pod}-{int(start)}.jsonl"
                lines: list[str] = []
                for _ in range(4):
                    t = start + rng.uniform(0, 3500)
                    v2 = t >= WEEK_START + 3.5 * 86400
                    rec = json.loads(json.dumps(base))
                    rec["time"] = datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
                    rec["prompt_version"] = "v2" if v2 else "v1"
                    rec["ttft"] = round(rng.lognormvariate(-1.9 if v2 else -0.25, 0.15), 6)
                    rec["prefill"] = round(rec["ttft"] * 0.8, 6)
                    rec["tokens"]["input"] = 6200
                    rec["tokens"]["cache_read"] = 5248 if v2 else 0
                    rec["trace_id"] = f"{rng.getrandbits(128):032x}"
                    lines.append(json.dumps(rec) + "\n")
                    written += 1
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(lines), encoding="utf-8")
                last_hour = day == 6 and hour == 21
                if not last_hour:  # a closed hour is compressed, then its .jsonl removed
                    with path.open("rb") as src, gzip.open(path.with_name(path.name + ".gz"), "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    if not (day == 3 and hour == 9 and pod == 2):  # this one was caught between the two steps
                        path.unlink()
    return written


def llmtap(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmtap", *args], cwd=ROOT, capture_output=True, text=True, timeout=60 * PATIENCE
    )


def test_a_week_from_six_pods_did_the_prompt_change_pay(tmp_path: Path) -> None:
    records = tmp_path / "records"
    written = week_of_records(records)
    assert written == 7 * 4 * PODS * 4
    done = llmtap("compare", str(records))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    # Every pod's every hour, the half-compressed one once: 168 files, each record once.
    assert lines[0] == f"llmtap compare: {records} (168 files, {written} records)", lines[0]
    assert lines[1] == "split: prompt version v1 against v2"
    assert lines[-1].startswith("caching gain: TTFT p50 7"), lines[-1]
    assert "cached share 0% to 85%" in lines[-1]
    # The same verdict, figures and intervals from plain Python, and from a glob of the compressed hours only.
    as_json = json.loads(llmtap("compare", str(records), "--json").stdout)
    python = json.loads(llmtap("compare", str(records), "--json", "--engine", "python").stdout)
    assert as_json == python and as_json["before"]["requests"] + as_json["after"]["requests"] == written
    globbed = llmtap("compare", str(records / "**" / "*.jsonl.gz"), "--json")
    assert json.loads(globbed.stdout)["kind"] == "gain", globbed.stderr
