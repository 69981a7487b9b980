"""The overview dashboard's capacity panels over two clusters, as Grafana draws them.

Two clusters each run a node named ``gpu-node-1:10064``, seen in one Prometheus (a global view:
federation, Thanos Query, a Mimir ruler's store) where only the external label ``cluster`` tells
them apart. Here one Prometheus scrapes two exporters as one job, the documented way a target gets
a label (a static config's ``labels``: https://prometheus.io/docs/prometheus/latest/configuration/
configuration/#static_config) and the instance relabelled to the node's name, as the shipped
monitors do. "Capacity by class" counts each cluster's devices apart; "Nodes with a free device of
the chosen class" lists the two nodes of one name as two (the panel once summed ``by (job,
instance, class)`` and made one node with both clusters' free devices); and a class's data link,
rendered for its row, opens the dashboard with that class chosen and the rest kept, where the nodes
panel lists that class's nodes.

eu-1's node: demo.xml with the 3g.40gb's process gone but its 11.4 GiB still held (unknown).
us-2's node: demo.xml with the 3g.40gb's process and memory gone (free). On both the 1g.10gb is
free (no process, nothing allocated: no kubelet) and the 2g.20gb and the whole card are in use.
"""

from __future__ import annotations

import json
import time
import urllib.parse

import pytest
import yaml

from mig_exporter.capacity_rules import FREE_PER_NODE
from mig_exporter.model.capacity import GPU_ONLY, count_by_class
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from proc_tree import make_proc
from test_capacity import LISTING, ONE_G, THREE_G, free_three_g_xml, held_three_g_xml
from test_dashboards import _dashboards
from test_grafana import DATASOURCE_UID, links, panels_through_grafana, rows, run_driver, url_state
from test_prometheus import STARTUP_S, _prometheus_binary, exporter, prometheus

pytestmark = pytest.mark.prometheus

NODE = "gpu-node-1:10064"  # both clusters' node
CLUSTERS = {"eu-1": held_three_g_xml, "us-2": free_three_g_xml}
CAPACITY = ("overview.json", "table", "Capacity by class")
NODES = ("overview.json", "table", "Nodes with a free device of the chosen class")
CAPACITY_PANELS = {CAPACITY[::2], NODES[::2]}  # (dashboard, title)


def two_clusters_config(addresses: dict[str, str]) -> str:
    """One job scraping each cluster's exporter (cluster name to address) every second, each
    target with its cluster label, the instance set to the node's name."""
    return yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "mig-exporter",
            "static_configs": [{"targets": [address], "labels": {"cluster": cluster}}
                               for cluster, address in addresses.items()],
            "relabel_configs": [{"target_label": "instance", "replacement": NODE}],
        }],
    })


def expected_capacity() -> list[dict]:
    """Each cluster's node counted by model/capacity.py (the exporter here sees the host's PIDs
    and no allocations: GPU_ONLY), a row per cluster and class."""
    return [{"Cluster": cluster, "Class": c.device_class, "Devices": c.devices, "Free": c.free, "In use": c.in_use,
             "Unknown": c.unknown, "Memory free": c.memory_free_bytes}
            for cluster, xml in CLUSTERS.items() for c in count_by_class(snapshot_from_smi(xml(), LISTING), GPU_ONLY)]


def by_row(table: list[dict] | str) -> list[dict]:
    assert isinstance(table, list), table
    return sorted(table, key=lambda r: json.dumps(r, sort_keys=True))


def class_link(class_name: str) -> str:
    """The URL "Capacity by class" gives a class's row on the dashboard as opened: this dashboard,
    its default time range, the provisioned data source, every node, and that class."""
    return (f"/d/mig-exporter-overview?from=now-6h&to=now&var-datasource={DATASOURCE_UID}&var-node=$__all"
            f"&var-class={class_name}")


def test_two_clusters_nodes_of_one_name_stay_two_and_a_class_links_to_its_nodes(fake_nvidia_smi, tmp_path):
    _prometheus_binary()
    proc = str(make_proc(tmp_path / "proc", []))  # the host's PID namespace
    smis = {cluster: fake_nvidia_smi(xml(), LISTING) for cluster, xml in CLUSTERS.items()}
    with exporter(smis["eu-1"], tmp_path, "--no-kubernetes", "--proc.root", proc) as eu, \
            exporter(smis["us-2"], tmp_path, "--no-kubernetes", "--proc.root", proc) as us, \
            prometheus("", tmp_path, two_clusters_config({"eu-1": eu.address, "us-2": us.address})) as prom:
        deadline = time.monotonic() + STARTUP_S
        scraped = f'count_over_time(mig_exporter_read_success{{instance="{NODE}"}}[1m]) >= 2'
        while len(prom.query(scraped)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        # Prometheus holds two nodes of one job and instance, told apart by cluster alone.
        assert sorted((s["metric"]["job"], s["metric"]["instance"], s["metric"]["cluster"])
                      for s in prom.query("mig_exporter_build_info")) == [
            ("mig-exporter", NODE, "eu-1"), ("mig-exporter", NODE, "us-2")]
        # What the panel's old `sum by (job, instance, class)` of the rule made of them: one node
        # with 2 free 1g.10gb.
        old = prom.query(f"sum by (job, instance, class) ({FREE_PER_NODE}) > 0")
        assert sorted((s["metric"]["instance"], s["metric"]["class"], s["value"][1]) for s in old) == [
            (NODE, ONE_G, "2"), (NODE, THREE_G, "1")]

        drawn = panels_through_grafana(prom, {}, only=CAPACITY_PANELS)
        # The class's link, followed: var-class as Grafana reads it from the URL.
        (href,) = links(drawn[CAPACITY], "Class")[THREE_G]
        chosen = urllib.parse.parse_qs(urllib.parse.urlsplit(href).query)["var-class"]
        followed = panels_through_grafana(prom, {}, chosen={"class": chosen[0]}, only=CAPACITY_PANELS)

    # One row per cluster and class: eu-1's 3g.40gb unknown, us-2's free.
    capacity = by_row(rows(drawn[CAPACITY]))
    assert capacity == by_row(expected_capacity())
    assert {(r["Cluster"], r["Free"], r["In use"], r["Unknown"]) for r in capacity if r["Class"] == THREE_G} == {
        ("eu-1", 0, 0, 1), ("us-2", 1, 0, 0)}

    # Every class with "All": the 1g.10gb free on both nodes of one name, us-2's 3g.40gb.
    node = {"Node": NODE, "In use": 0, "Unknown": 0}
    assert by_row(rows(drawn[NODES])) == by_row([
        {"Cluster": "eu-1", "Class": ONE_G, "Free": 1, **node},
        {"Cluster": "us-2", "Class": ONE_G, "Free": 1, **node},
        {"Cluster": "us-2", "Class": THREE_G, "Free": 1, **node},
    ])

    # Each class row links to this dashboard with the class chosen, time range and variables kept.
    assert links(drawn[CAPACITY], "Class") == {c["Class"]: [class_link(c["Class"])] for c in capacity}
    assert chosen == [THREE_G]
    # Followed: the nodes with a free 3g.40gb, and "Capacity by class" still every class.
    assert rows(followed[NODES]) == [{"Cluster": "us-2", "Node": NODE, "Class": THREE_G, "Free": 1, **node}]
    assert by_row(rows(followed[CAPACITY])) == capacity


def test_a_class_link_is_rendered_as_grafana_sanitizes_it():
    """The link with answers made by hand, no Prometheus needed: one class without a cluster label
    (no Cluster column then), and a class with a ``+`` (the ``+me`` MIG profiles, which carry the
    media engines). Grafana sanitizes a data link's URL after filling it in (@grafana/data's
    locationUtil.processUrl, @braintree/sanitize-url), which decodes what the "uriencode" format
    encoded; and a query string's ``+`` is read as a space (URLSearchParams). So the ``+me`` class
    reaches $class as ``... me``, and matches nothing: docs/dashboards.md says to pick it by hand."""
    (panel,) = [p for p in _dashboards()["overview.json"]["panels"] if p["title"] == "Capacity by class"]
    plus = "a100-80g-mig-1g.10gb+me"
    answers = [{"query": t, "data": {"resultType": "vector", "result": [
        {"metric": {"class": name}, "value": [0, "1"]} for name in (THREE_G, plus)]}} for t in panel["targets"]]
    context = url_state(_dashboards()["overview.json"])
    (result,) = run_driver([{"panel": panel, "answers": answers, "context": context}])
    assert [f["displayName"] for f in result["frames"][0]["fields"]] == [
        "Class", "Devices", "Free", "In use", "Unknown", "Memory free"]
    assert links(result, "Class") == {THREE_G: [class_link(THREE_G)], plus: [class_link(plus)]}
    titles = [link["title"] for f in result["frames"][0]["fields"] for row in f["links"] or [] for link in row]
    assert sorted(titles) == sorted(f"Nodes with a free {name}" for name in (THREE_G, plus))
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(class_link(plus)).query)["var-class"] == [
        "a100-80g-mig-1g.10gb me"]
