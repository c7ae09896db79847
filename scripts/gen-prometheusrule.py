#!/usr/bin/env python3
"""Writes deploy/kubernetes/overlays/monitoring/prometheusrule.yaml from
deploy/prometheus/kvd-rules.yaml (the rules promtool checks), so the two never differ; the deploy
test fails when they do."""
import os

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rules = open(os.path.join(root, "deploy", "prometheus", "kvd-rules.yaml")).read()
body = "\n".join("  " + line if line.strip() else "" for line in rules.splitlines() if not line.startswith("#"))
header = """# kvd's alert rules as a PrometheusRule (the Prometheus Operator loads it). spec.groups is
# deploy/prometheus/kvd-rules.yaml verbatim (scripts/gen-prometheusrule.py writes this file),
# which `promtool check rules` checks; the deploy test fails when the two differ. Change
# `release` to the label your Prometheus selects rules by (kube-prometheus-stack: its Helm
# release name).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvd
  namespace: kvd
  labels:
    app.kubernetes.io/name: kvd
    release: kube-prometheus-stack
spec:
"""
out = os.path.join(root, "deploy", "kubernetes", "overlays", "monitoring", "prometheusrule.yaml")
open(out, "w").write(header + body + "\n")
print("wrote", out)
