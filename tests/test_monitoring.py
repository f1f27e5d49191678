"""deploy/monitoring against a real Prometheus (Debian's `prometheus` package: `apt-get install prometheus`;
skipped, saying so, only where the binary is missing): it scrapes a scheduler, a simulated worker and a gateway
on loopback every second while requests run; every PromQL expression of the shipped dashboard and alert rules
evaluates without error and returns series (an alert's expression without its final threshold, which would
hide a quiet series), and the counters it reads agree with what the client saw. The compose file of the
monitoring services is checked against the compose spec."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from client import Client
from client.launcher import free_port
from tests import sim_cluster
from tests.test_deploy import _compose_validator
from tests.test_gateway import Gateway

pytestmark = pytest.mark.timeout(240)

MONITORING = Path(__file__).resolve().parents[1] / "deploy" / "monitoring"
PROMETHEUS = shutil.which("prometheus")
REQUESTS = 12
THRESHOLD = re.compile(r"\s*[<>]=?\s*[0-9.e+-]+\s*$")


def _expressions() -> list[tuple[str, str]]:
    dashboard = json.loads((MONITORING / "splitserve-dashboard.json").read_text())
    exprs = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    exprs += [(r["alert"], THRESHOLD.sub("", r["expr"])) for g in rules["groups"] for r in g["rules"]]
    return exprs


def test_every_alert_has_a_threshold_and_the_rules_load():
    for name, expr in _expressions():
        assert "splitserve" in expr, name
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    assert all(THRESHOLD.search(r["expr"]) for g in rules["groups"] for r in g["rules"])
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "rules", str(MONITORING / "alerts.yml")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_monitoring_compose_file_matches_the_compose_spec():
    doc = yaml.safe_load((MONITORING / "compose.yml").read_text())
    errors = list(_compose_validator().iter_errors(doc))
    assert not errors, [e.message for e in errors]
    for service in doc["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (MONITORING.parent / source).exists(), source  # relative to deploy/, the first file's folder


def _query(port: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian: apt-get install prometheus)")
def test_a_real_prometheus_evaluates_every_shipped_expression(tmp_path):
    model = sim_cluster.config_only_model(tmp_path / "model")
    metrics, worker_metrics = free_port(), free_port()
    cluster = sim_cluster.start_simulated(model, tmp_path / "logs", worker_args=["--metrics-port", str(worker_metrics)],
                                          scheduler_args=["--metrics-port", str(metrics)])
    gateway = prom = None
    try:
        gateway = Gateway(cluster.address, tmp_path / "gateway.log", "--workers", "2").wait_healthy()
        prom_port = free_port()
        # 2 s: a scrape of the scheduler gathers every process of its tree, which a loaded CI box may not do in 1
        config = {"global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"},
                  "scrape_configs": [
                      {"job_name": "splitserve-scheduler", "static_configs": [{"targets": [f"127.0.0.1:{metrics}"]}]},
                      {"job_name": "splitserve-worker", "static_configs": [{"targets": [f"127.0.0.1:{worker_metrics}"]}]},
                      {"job_name": "splitserve-gateway", "static_configs": [{"targets": [f"127.0.0.1:{gateway.port}"]}]}]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        with open(tmp_path / "prometheus.log", "wb") as log:
            prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=subprocess.STDOUT)
        sim_cluster.wait_for("prometheus scrapes all three", lambda: _up(prom_port) == 3, timeout=60, interval=0.5)

        def value(expr: str) -> float:
            result = _query(prom_port, expr)["data"]["result"]
            return float(result[0]["value"][1]) if result else 0.0

        # Counts are read as growth from what the first scrapes saw (in a full suite, a port can lead to a process
        # other tests left behind; only what this test did must show as growth).
        time.sleep(3)
        refused = 'sum(splitserve:request_rejected_total{status="INVALID_ARGUMENT"})'
        base = {e: value(e) for e in ("sum(splitserve:request_success_total)",
                                      "sum(splitserve:generation_tokens_total)", refused)}

        def grew(expr: str) -> float:
            return value(expr) - base.get(expr, 0.0)
        with Client(cluster.address, timeout=60) as c:
            with pytest.raises(grpc.RpcError):  # one refusal: its counter's series exists
                c.complete(token_ids=[1, 2], top_p=0.0)
            for i in range(REQUESTS):  # spread over a few scrapes, so that rate() has two points and more
                c.complete(token_ids=[1, 2, 3, i], max_tokens=8, ignore_eos=True)
                httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
                time.sleep(0.25)

        def counted() -> bool:  # the last scrapes of every target came after the last request
            return (grew("sum(splitserve:request_success_total)") == 2 * REQUESTS
                    and value('sum(splitserve:gateway_http_requests_total{route="/v1/completions"})') == REQUESTS)

        try:
            sim_cluster.wait_for("prometheus sees every finished request", counted, timeout=60, interval=0.5)
        except AssertionError as e:
            targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/targets",
                                                        timeout=10).read())["data"]["activeTargets"]
            raise AssertionError(f"{e}; requests {grew('sum(splitserve:request_success_total)')} more, gateway "
                                 f"{value('sum(splitserve:gateway_http_requests_total)')}; targets "
                                 f"{[(t['labels']['job'], t['health'], t['lastError']) for t in targets]}") from None
        failures = []
        for name, expr in _expressions():
            answer = _query(prom_port, expr)
            if answer["status"] != "success" or not answer["data"]["result"]:
                failures.append(f"{name}: {expr} -> {answer.get('error') or 'no series'}")
        assert not failures, "\n".join(failures)
        assert grew("sum(splitserve:generation_tokens_total)") == REQUESTS * 8 + REQUESTS * 2
        assert value('sum(splitserve:gateway_http_requests_total{route="/v1/completions",status="200"})') == REQUESTS
        assert grew(refused) == 1
        labels = _query(prom_port, 'count by (model_name) (splitserve:worker_alive)')["data"]["result"]
        assert [r["metric"]["model_name"] for r in labels] == [model.name]
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(15)
        if gateway is not None:
            gateway.stop()
        cluster.stop()


def _up(port: int) -> int:
    try:
        result = _query(port, "sum(up)")["data"]["result"]
    except OSError:
        return 0
    return int(float(result[0]["value"][1])) if result else 0
