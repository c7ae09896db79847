#!/usr/bin/env python3
"""Writes deploy/grafana/kvd-dashboard.json: one row per concern (overview, memory, requests,
tiers, Redis, router events), every query filtered by the `instance` (node) variable. The deploy
test checks that every metric it names is one a running kvd exports."""
import json
import os

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_TOTAL = 'state!="total"'
LE_1S = 'le="1"'


def sel(metric, extra=""):
    return f'{metric}{{instance=~"$instance"{("," + extra) if extra else ""}}}'


ROWS = [
    ("Overview", [
        ("Prefix hit rate (tokens)", "percentunit", [
            (f"sum by (instance) (rate({sel('kvd_hit_tokens_total')}[5m])) / clamp_min(sum by (instance) "
             f"(rate({sel('kvd_hit_tokens_total')}[5m]) + rate({sel('kvd_miss_tokens_total')}[5m])), 1)", "{{instance}}")]),
        ("Memory pressure (0 normal, 1 high, 2 critical)", "short", [
            (f"max by (instance) ({sel('kvd_pressure_level')})", "{{instance}}")]),
        ("Attached workers and live requests", "short", [
            (f"sum by (instance) ({sel('kvd_attached_workers')})", "workers {{instance}}"),
            (f"sum by (instance) ({sel('kvd_live_requests')})", "requests {{instance}}")]),
        ("RPC latency p99", "s", [
            (f"histogram_quantile(0.99, sum by (le, method) (rate({sel('kvd_rpc_latency_seconds_bucket')}[5m])))", "{{method}}")]),
    ]),
    ("Device memory", [
        # The states partition the pool (free + owned + cached_referenced + cached_evictable = total).
        ("KV bytes by state (stacked: the pool)", "bytes", [
            (f"sum by (state) ({sel('kvd_bytes', NOT_TOTAL)})", "{{state}}")], True),
        ("Reserved vs budget", "bytes", [
            (f"sum({sel('kvd_reserved_bytes')})", "reserved"), (f"sum({sel('kvd_budget_bytes')})", "budget")]),
        ("Evictions by reason", "ops", [
            (f"sum by (reason) (rate({sel('kvd_evictions_total')}[5m]))", "{{reason}}")]),
    ]),
    ("Requests", [
        ("Admission wait p50 / p99 (per request)", "s", [
            (f"histogram_quantile(0.5, sum by (le) (rate({sel('kvd_admission_wait_seconds_bucket')}[5m])))", "p50"),
            (f"histogram_quantile(0.99, sum by (le) (rate({sel('kvd_admission_wait_seconds_bucket')}[5m])))", "p99")]),
        ("Requests that waited over 1 s", "percentunit", [
            (f"1 - sum(rate({sel('kvd_admission_wait_seconds_bucket', LE_1S)}[5m])) / "
             f"clamp_min(sum(rate({sel('kvd_admission_wait_seconds_count')}[5m])), 1e-9)", "share")]),
        ("Admit calls by result", "ops", [
            (f"sum by (result) (rate({sel('kvd_admissions_total')}[5m]))", "{{result}}")]),
    ]),
    ("Tiers (host, disk)", [
        ("Tier bytes", "bytes", [(f"sum by (tier, state) ({sel('kvd_tier_bytes')})", "{{tier}} {{state}}")]),
        ("Demotions and promotions", "ops", [
            (f"sum by (to) (rate({sel('kvd_demotions_total')}[5m]))", "down to {{to}}"),
            (f"sum by (from) (rate({sel('kvd_promotions_total')}[5m]))", "up from {{from}}")]),
        ("Pending persistence", "short", [
            (f"sum by (kind) ({sel('kvd_pending_persistence_records')})", "{{kind}}")]),
        ("Disk failures", "short", [
            (f"sum(increase({sel('kvd_tier_write_failures_total')}[15m]))", "write failures"),
            (f"sum(increase({sel('kvd_tier_checksum_failures_total')}[1h]))", "checksum failures"),
            (f"min({sel('kvd_last_flush_durable')})", "last flush durable")]),
    ]),
    ("Redis tier", [
        ("Failed share of calls", "percentunit", [
            (f"sum by (instance) (rate({sel('kvd_remote_errors_total')}[5m]) + rate({sel('kvd_remote_skipped_total')}[5m])) / "
             f"clamp_min(sum by (instance) (rate({sel('kvd_remote_calls_total')}[5m])), 1e-9)", "{{instance}}")]),
        ("Lookups and hits", "ops", [
            (f"sum(rate({sel('kvd_remote_lookups_total')}[5m]))", "lookups"),
            (f"sum(rate({sel('kvd_remote_hit_blocks_total')}[5m]))", "blocks found")]),
        ("Blocks moved", "ops", [
            (f"sum by (direction) (rate({sel('kvd_remote_blocks_total')}[5m]))", "{{direction}}")]),
    ]),
    ("Router events", [
        ("Events published", "ops", [
            (f"sum(rate({sel('kvd_router_events_total')}[5m]))", "events"),
            (f"sum(rate({sel('kvd_router_event_batches_total')}[5m]))", "batches")]),
        ("Events lost", "short", [
            (f"sum by (reason) (increase({sel('kvd_router_events_lost_total')}[15m]))", "{{reason}}")]),
        ("Replayed batches", "ops", [
            (f"sum(rate({sel('kvd_router_replayed_batches_total')}[5m]))", "replayed")]),
    ]),
]

panels = []
y = 0
pid = 1
for title, items in ROWS:
    panels.append({"id": pid, "type": "row", "title": title, "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
    pid += 1
    y += 1
    for i, item in enumerate(items):
        ptitle, unit, targets = item[0], item[1], item[2]
        stacked = len(item) > 3 and item[3]
        defaults = {"unit": unit}
        if stacked:
            defaults["custom"] = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60}
        panels.append({
            "id": pid, "title": ptitle, "type": "timeseries",
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "targets": [{"refId": chr(65 + k), "expr": e, "legendFormat": legend} for k, (e, legend) in enumerate(targets)],
        })
        pid += 1
    y += 8 * ((len(items) + 1) // 2)

dashboard = {
    "title": "kvd", "uid": "kvd-overview", "schemaVersion": 38, "version": 2, "editable": True,
    "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "tags": ["kvd"],
    "templating": {"list": [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
        {"name": "instance", "label": "Node", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": {"query": "label_values(kvd_build_info, instance)", "refId": "instance"},
         "definition": "label_values(kvd_build_info, instance)", "refresh": 2, "multi": True, "includeAll": True,
         "current": {"text": "All", "value": "$__all"}, "sort": 1},
    ]},
    "panels": panels,
}
out = os.path.join(root, "deploy", "grafana", "kvd-dashboard.json")
with open(out, "w") as f:
    json.dump(dashboard, f, indent=2)
    f.write("\n")
print("wrote", out, len(panels), "panels")
