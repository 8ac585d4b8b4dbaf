"""helm/llmtap/README.md: its values table is generated from values.yaml (the helm-docs convention), so it cannot
drift; and its prose states only what is so (metric names that exist, links to the pages that cover them)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.generators import load

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "llmtap"
chart_docs = load("chart")


def test_the_values_table_is_current() -> None:
    run = subprocess.run(
        [sys.executable, "docs/generate/chart.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr


def _copy(tmp_path: Path) -> Path:
    for name in ("values.yaml", "values.schema.json", "README.md"):
        (tmp_path / name).write_text((CHART / name).read_text(encoding="utf-8"), encoding="utf-8")
    return tmp_path


def test_a_changed_value_makes_the_table_stale(tmp_path: Path) -> None:
    chart = _copy(tmp_path)
    values = chart / "values.yaml"
    text = values.read_text(encoding="utf-8")
    values.write_text(text.replace("replicaCount: 2", "replicaCount: 3"), encoding="utf-8")
    said: list[str] = []
    assert chart_docs.main(["--check", "--chart", str(chart)], write=said.append) == 1
    assert "stale" in said[0]
    assert chart_docs.main(["--chart", str(chart)], write=said.append) == 0
    assert "| `replicaCount` | int | `3` |" in (chart / "README.md").read_text(encoding="utf-8")


def test_a_value_without_a_comment_is_refused(tmp_path: Path) -> None:
    chart = _copy(tmp_path)
    values = chart / "values.yaml"
    values.write_text(values.read_text(encoding="utf-8") + "\nundocumented: 1\n", encoding="utf-8")
    said: list[str] = []
    assert chart_docs.main(["--check", "--chart", str(chart)], write=said.append) == 1
    assert said == ["values without a '# --' comment: undocumented"]


def test_every_leaf_value_has_a_row_with_its_default() -> None:
    text = (CHART / "values.yaml").read_text(encoding="utf-8")
    found = {r.path: r for r in chart_docs.rows(text, _schema())}
    assert chart_docs.undocumented(text) == []
    values = yaml.safe_load(text)
    assert found["config.slo.e2e_ms"].kind == "float or null"
    assert found["terminationGracePeriodSeconds"].kind == "int or null"
    assert found["config.routes"].default.startswith('[{"prefix": "/"')
    assert found["replicaCount"].default == str(values["replicaCount"])
    assert "config.routes.prefix" not in found  # a list's items are its key's row


def _schema() -> dict[str, object]:
    data: dict[str, object] = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    return data


def test_metric_names_in_the_readme_exist() -> None:
    """Every llmtap metric the README names is one llmtap exposes (docs/reference.md lists them, generated)."""
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    reference = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(llmtap_[a-z_]+)", readme))
    assert named, "the README names no metric"
    # Exposed only with OTLP on (observable counters of the exporters): not in the generated reference.
    otlp_only = {"llmtap_telemetry_spans_dropped_total", "llmtap_telemetry_exports_failed_total"}
    assert {n for n in named if f"`{n}`" not in reference} <= otlp_only
    assert "llmtap_telemetry_dropped_total" not in readme
    assert "worker thread" not in readme


def test_the_readmes_links_reach_their_pages_and_sections() -> None:
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\((\.\./[^)]+)\)", readme):
        page, _, anchor = target.partition("#")
        path = (CHART / page).resolve()
        assert path.is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, target
    assert "../../docs/fleet.md#records-across-replicas" in readme
