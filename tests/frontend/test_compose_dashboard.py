"""docker/: the compose file's services, Prometheus' targets and the Grafana dashboard's queries.

No Docker engine runs here, so what can be checked without one is: the
scheduler and the frontend run the slim control-plane image and the agents the
engine image, every service has a healthcheck, Prometheus scrapes every shoal component where it
serves /metrics, Grafana is provisioned with the dashboard, and every metric
the dashboard queries exists on the /metrics of a live component (frontend,
agent and scheduler, on the real nats-server).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scheduler.service import SchedulerConfig, SchedulerService
from tests.frontend.cluster import frontend_cluster
from tests.scrape import metric_names, serving

DOCKER = Path(__file__).parents[2] / "docker"
yaml = pytest.importorskip("yaml")


def _compose() -> dict[str, object]:
    compose: dict[str, object] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return compose


def _queried_metrics() -> set[str]:
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "shoal.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return {name for expr in exprs for name in re.findall(r"\bshoal_[a-z0-9_]+", expr)}


def test_every_service_has_a_healthcheck_and_prometheus_scrapes_every_component() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict)
    assert {"nats", "jaeger", "scheduler", "scheduler-standby", "agent-0", "agent-1", "frontend",
            "prometheus", "grafana"} <= set(services)
    assert [name for name, service in services.items() if "healthcheck" not in service] == []
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    groups = [group for job in prometheus["scrape_configs"] for group in job["static_configs"]]
    targets = {target for group in groups for target in group["targets"]}
    shoal = {name for name, service in services.items() if "build" in service}
    assert {target.split(":")[0] for target in targets} == shoal
    for target in targets:
        host, port = target.split(":")
        command = services[host]["command"]
        assert port == (command[command.index("--port") + 1] if host == "frontend"
                        else command[command.index("--metrics-port") + 1])
    for name in shoal:  # spans go to Jaeger the standard way
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"


def _dockerfile_stages() -> dict[str, str]:
    """docker/Dockerfile's stages by name, each its instructions with continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DOCKER / "Dockerfile").read_text())
    stages: dict[str, str] = {}
    name = ""
    for line in text.splitlines():
        if found := re.match(r"FROM \S+ AS (\S+)", line):
            name = found.group(1)
            stages[name] = ""
        elif name and not line.lstrip().startswith("#"):
            stages[name] += line + "\n"
    return stages


def test_the_control_plane_runs_the_slim_image_and_the_agents_the_engine_image() -> None:
    """The scheduler and the frontend run the base install (no torch); agents get torch."""
    services = _compose()["services"]
    assert isinstance(services, dict)
    targets = {name: service["build"]["target"] for name, service in services.items() if "build" in service}
    assert targets == {"scheduler": "control-plane", "scheduler-standby": "control-plane",
                       "frontend": "control-plane", "agent-0": "engine", "agent-1": "engine"}
    stages = _dockerfile_stages()
    control, engine = stages["control-plane"], stages["engine"]
    assert re.search(r"pip install [^\n]*\s\.$", control, re.MULTILINE), control  # the base install
    assert "torch" not in control and ".[" not in control, control  # no extra
    assert 'pip install --no-cache-dir ".[torch]"' in engine, engine
    for name in ("agent-0", "agent-1"):
        command = services[name]["command"]
        assert command[command.index("--engine") + 1] == "torch"


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard() -> None:
    grafana = _compose()["services"]["grafana"]  # type: ignore[index]
    volumes = grafana["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in volumes
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/shoal.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    dashboard = json.loads((DOCKER / "grafana/dashboards/shoal.json").read_text())
    uids = {t["datasource"]["uid"] for panel in dashboard["panels"] for t in panel["targets"]}
    assert uids == {source["datasources"][0]["uid"]}
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("throughput", "first token", "per output token", "freeness", "migration", "downtime"):
        assert topic in titles


async def test_every_metric_the_dashboard_queries_exists_on_a_live_component(nats_url: str) -> None:
    queried = _queried_metrics()
    assert len(queried) >= 10
    async with frontend_cluster(nats_url, instances=1) as cluster:
        async with cluster.client() as client:
            response = await client.get("/metrics")
            assert response.status_code == 200
        from prometheus_client.parser import text_string_to_metric_families

        frontend = set()
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
        for family in text_string_to_metric_families(response.text):
            frontend.update(family.name + s for s in suffixes.get(family.type, ("",)))
            frontend.update(sample.name for sample in family.samples)
        with serving(next(iter(cluster.agents.values())).metrics.registry) as url:
            agent = await metric_names(url)
        scheduler_service = SchedulerService(cluster.buses[-1], SchedulerConfig())
        with serving(scheduler_service.metrics.registry) as url:
            scheduler = await metric_names(url)
    assert queried - (frontend | agent | scheduler) == set()
    # each component's own panels are fed: the dashboard reads all three
    assert queried & frontend and queried & agent and queried & (scheduler - frontend)
