"""The Grafana dashboard (deploy/grafana/dashboards/pagefleet.json) asks only for metrics
pagefleet exports: a real cluster (gateway, scheduler, a worker on the CPU) serves a few
requests, every component's /metrics is scraped, and every metric name each PromQL
expression of the dashboard names (its panels' queries and its variables') must be a series
in one of those scrapes (a histogram's ``_bucket``, ``_sum`` and ``_count`` included).
Names are checked, not labels: ``model`` and ``shard`` are the labels the queries group by.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from cluster_fixtures import PROMPTS, generate_all, start_cluster
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(180)

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "pagefleet.json"
# PromQL words that are not metric names (operators and modifiers; functions and
# aggregations are told apart by the "(" after them).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan", "atan2"}
NAME = re.compile(r"(?<![\w.:$])([a-zA-Z_:][\w:]*)\s*(\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's ``$variables`` allowed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings (label values)
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range and subquery durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    return {m.group(1) for m in NAME.finditer(expr) if not m.group(2) and m.group(1) not in KEYWORDS}


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(where, PromQL)`` for every panel target (rows' nested panels too) and every query
    variable (``label_values(EXPR, LABEL)``: its EXPR)."""
    out = []
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        for t in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {t['refId']}", t["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", q)
            out.append((f"variable ${var['name']}", m.group(1) if m else q))
    return out


def test_metric_names_are_read_from_promql():
    assert metric_names('histogram_quantile(0.99, sum by (le, model) (rate(a:b_bucket{model=~"$model"}[$__rate_interval])))') \
        == {"a:b_bucket"}
    assert metric_names("sum by (model, shard) (rate(x_total[5m])) / sum without (shard) (y offset 5m) > bool 0") \
        == {"x_total", "y"}
    assert metric_names('max(kv{shard="s0"}) * 1e3 and on (shard) up') == {"kv", "up"}


def scrape(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_query_in_the_dashboard_names_a_metric_pagefleet_exports(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    found = queries(dashboard)
    assert len(found) > 10
    cluster = start_cluster(tmp_path, num_workers=1, metrics_port=0, worker_args=["--num-blocks", "64"])
    try:
        outs = generate_all(cluster.gateway_target, PROMPTS[:4], max_tokens=8)
        assert all(len(o.token_ids) == 8 for o in outs)
        scraped = {name: scrape(cluster.metrics_url(name)) for name in cluster.metrics_ports}
    finally:
        cluster.stop()
    assert {n.split("-")[0] for n in scraped} == {"gateway", "scheduler", "worker"}
    exported = set().union(*scraped.values())
    missing = []
    for where, expr in found:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        missing += [f"{where}: {n}" for n in sorted(names - exported)]
    assert not missing, "the dashboard asks for metrics nobody exports:\n" + "\n".join(missing)
    # and the check has teeth: a misspelt name is missing
    assert metric_names("rate(pagefleet:generation_token_total[1m])") - exported
