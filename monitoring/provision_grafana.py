"""Provision a Prometheus datasource and the Verify-PD dashboard into a Grafana, via grafana-client.

    python monitoring/provision_grafana.py --grafana-url http://127.0.0.1:3000 \
        --user admin --password admin --prometheus-url http://127.0.0.1:9090
    python monitoring/provision_grafana.py --grafana-url https://grafana.example --api-key TOKEN \
        --prometheus-url http://prometheus:9090

Idempotent: the datasource (by name) is created or updated, and the dashboard (uid "verify-pd")
is uploaded with overwrite; its $datasource variable is set to the provisioned datasource.

Not run against a live Grafana in this repository: no Grafana server can be installed on the
project's machines (it is neither in Debian's archive nor on PyPI), so this command has been
checked only up to the client library, not against a server. The dashboard's queries are
checked against a live Prometheus by monitoring/check_dashboard.py
(tests/test_dashboard_queries.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

DEFAULT_DASHBOARD = Path(__file__).resolve().parent / "grafana" / "verify-pd-dashboard.json"
DEFAULT_DATASOURCE_NAME = "Verify-PD Prometheus"


def datasource_payload(name: str, prometheus_url: str) -> dict:
    return {"name": name, "type": "prometheus", "access": "proxy", "url": prometheus_url,
            "isDefault": False, "jsonData": {"httpMethod": "POST", "timeInterval": "5s"}}


def upsert_datasource(api: GrafanaApi, name: str, prometheus_url: str) -> dict:
    """Create the datasource, or update the one of that name; returns Grafana's record of it."""
    payload = datasource_payload(name, prometheus_url)
    try:
        existing = api.datasource.get_datasource_by_name(name)
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
        api.datasource.create_datasource(payload)
    else:
        api.datasource.update_datasource(existing["id"], {**payload, "uid": existing["uid"]})
    return api.datasource.get_datasource_by_name(name)


def dashboard_payload(dashboard: dict, datasource: dict, folder_uid: str | None) -> dict:
    """The /api/dashboards/db body: the dashboard with $datasource pointing at `datasource`."""
    dashboard = json.loads(json.dumps(dashboard))  # a deep copy; the file's JSON stays as is
    dashboard.pop("id", None)  # Grafana matches on uid; a stale numeric id would conflict
    for variable in dashboard["templating"]["list"]:
        if variable["name"] == "datasource":
            variable["current"] = {"selected": True, "text": datasource["name"],
                                   "value": datasource["uid"]}
    payload = {"dashboard": dashboard, "overwrite": True,
               "message": "provisioned by monitoring/provision_grafana.py"}
    if folder_uid is not None:
        payload["folderUid"] = folder_uid
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grafana-url", required=True)
    auth = parser.add_mutually_exclusive_group(required=True)
    auth.add_argument("--api-key", help="service-account token or API key")
    auth.add_argument("--user", help="basic-auth user (with --password)")
    parser.add_argument("--password", default=None)
    parser.add_argument("--prometheus-url", required=True,
                        help="Prometheus as Grafana's server reaches it")
    parser.add_argument("--datasource-name", default=DEFAULT_DATASOURCE_NAME)
    parser.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD)
    parser.add_argument("--folder-uid", default=None)
    args = parser.parse_args(argv)
    if args.user is not None and args.password is None:
        parser.error("--user needs --password")
    credential = args.api_key if args.api_key is not None else (args.user, args.password)
    api = GrafanaApi.from_url(args.grafana_url, credential=credential, timeout=10.0)
    datasource = upsert_datasource(api, args.datasource_name, args.prometheus_url)
    dashboard = json.loads(args.dashboard.read_text())
    answer = api.dashboard.update_dashboard(dashboard_payload(dashboard, datasource,
                                                              args.folder_uid))
    print(f"datasource {datasource['name']!r} (uid {datasource['uid']}) -> {args.prometheus_url}")
    print(f"dashboard {dashboard['title']!r}: {answer.get('status')} at "
          f"{args.grafana_url.rstrip('/')}{answer.get('url', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
