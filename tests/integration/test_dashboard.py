"""config/grafana/quicserve.json against what a running gateway really exports on /metrics.

A dashboard whose query names a metric nobody exports draws an empty panel and nobody
notices until the incident. So: a real ``quicserve serve --engine synthetic`` serves a
plain and a streamed chat completion, a 404 and worker Stats; every metric any query
or template variable names must be in its ``/metrics``, with the labels the queries
select on.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_gateway_e2e import start_gateway, stop_gateway

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "config" / "grafana" / "quicserve.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_SELECTOR = re.compile(r"\b(quicserve_[a-z0-9_]+)\s*(\{[^}]*\})?")


def queries(dash: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def exported(text: str) -> dict[str, set[str]]:
    """Every series name /metrics can show -> the label names seen on it (none yet: empty set)."""
    names: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for suffix in _SUFFIXES.get(fam.type, ("",)):
            names.setdefault(fam.name + suffix, set())
        for s in fam.samples:
            names.setdefault(s.name, set()).update(k for k in s.labels if k != "le")
    return names


def scrape_with_worker_stats(url: str) -> str:
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        if "\nquicserve_worker_kv_usage_ratio{" in text or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_dashboard_queries_name_exported_metrics(tmp_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for slo in ("p95 latency", "ttft", "error rate", "saturation", "kv cache usage", "prefix cache hits"):
        assert slo in titles, f"no {slo!r} panel in {titles}"
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dash["panels"] if p["type"] != "row")

    gw = start_gateway(tmp_path)
    try:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        assert httpx.post(gw.http + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
        with httpx.stream("POST", gw.http + "/v1/chat/completions", json={**chat, "stream": True}, timeout=30) as r:
            assert r.status_code == 200 and "data: [DONE]" in r.read().decode()
        try:
            urllib.request.urlopen(gw.http + "/v1/nothing-here", timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code == 404
        text = scrape_with_worker_stats(gw.http)
    finally:
        assert stop_gateway(gw) == 0
    have = exported(text)
    used: dict[str, set[str]] = {}
    for q in queries(dash):
        for name, selector in _SELECTOR.findall(q):
            used.setdefault(name, set()).update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector or ""))
        for name, label in re.findall(r"label_values\((quicserve_\w+),\s*(\w+)\)", q):
            used.setdefault(name, set()).add(label)
    missing = sorted(set(used) - set(have))
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
    for name, labels in used.items():
        if have[name]:  # series present: the labels selected on must be among theirs
            assert labels <= have[name], (name, labels, have[name])
    # the SLO panels' series had samples in this run (not just a HELP line)
    for name in ("quicserve_request_duration_seconds_bucket", "quicserve_time_to_first_token_seconds_bucket",
                 "quicserve_requests_total", "quicserve_worker_kv_usage_ratio", "quicserve_worker_prefix_hit_ratio"):
        assert re.search(rf"^{name}\{{", text, re.M), name
