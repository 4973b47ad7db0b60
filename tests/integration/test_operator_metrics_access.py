"""The operator's /metrics behind the API server's authentication and authorization (issue 35, point 3), on the
real API server: the operator reviews with the ServiceAccount and ClusterRole the chart gives it, a scraper
reads only with a token whose user holds the chart's metrics-reader ClusterRole, over HTTPS when a certificate
is mounted. The figures a user meets: 401 without or with a bad token, 403 naming the user, 200 with the
series, and one review per token per minute, not per scrape."""
from __future__ import annotations

import ssl
import subprocess
import urllib.error
import urllib.request

import pytest
import yaml

from localcluster.pki import free_port
from tests.integration.operator_process import REPO, delete_cluster_scoped

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
RELEASE = "mx"


def _token(core, ns: str, sa: str) -> str:
    from kubernetes import client

    core.create_namespaced_service_account(ns, {"metadata": {"name": sa}})
    req = core.create_namespaced_service_account_token(
        sa, ns, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[],
                                                                                    expiration_seconds=600)))
    return req.status.token


def _operator_client(kube, token: str):
    """An API client with the kubeconfig's server and CA but the operator ServiceAccount's token: what the
    chart's pod has, so the chart's RBAC is what is tested, not the admin's."""
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=kube.kubeconfig, client_configuration=cfg)
    cfg.cert_file = cfg.key_file = None
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(cfg)


def _get(url: str, token: str | None, ctx: ssl.SSLContext) -> tuple[int, str, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def test_metrics_need_a_token_the_api_server_authorizes_for_get_metrics(kube, tmp_path):
    from kubernetes import client

    from embedops_operator import metrics
    from embedops_operator.metrics_access import KubernetesAccessReview

    if not kube.helm:
        pytest.skip("helm not available (make cluster-binaries)")
    api = kube.api_client()
    core = client.CoreV1Api(api)
    with kube.namespace("metrics-access") as ns:
        out = subprocess.run([kube.helm, "template", RELEASE, str(REPO / "charts" / "embedops-operator"), "-n", ns,
                              "--set", f"metrics.readers[0].namespace={ns}", "--set", "metrics.readers[0].name=reader"],
                             capture_output=True, text=True, check=True).stdout
        rbac = [d for d in yaml.safe_load_all(out) if d and d["kind"] in ("ClusterRole", "ClusterRoleBinding")
                and d["metadata"]["name"].endswith(("-metrics-auth", "-metrics-reader"))]
        assert sorted(d["kind"] for d in rbac) == ["ClusterRole", "ClusterRole", "ClusterRoleBinding",
                                                   "ClusterRoleBinding"], [d["metadata"]["name"] for d in rbac]
        operator_sa = next(d for d in rbac if d["kind"] == "ClusterRoleBinding"
                           and d["metadata"]["name"].endswith("-metrics-auth"))["subjects"][0]["name"]
        kube.apply(rbac)
        tls = tmp_path / "tls"
        tls.mkdir()
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", tls / "tls.key",
                        "-out", tls / "tls.crt", "-subj", "/CN=embedops-operator-metrics", "-days", "1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        operator_api = None
        server = None
        try:
            operator_api = _operator_client(kube, _token(core, ns, operator_sa))
            reader, stranger = _token(core, ns, "reader"), _token(core, ns, "stranger")
            access = KubernetesAccessReview(operator_api)
            port = free_port()
            server = metrics.serve(f"127.0.0.1:{port}", access, str(tls))
            assert server is not None
            url = f"https://127.0.0.1:{port}/metrics"
            ctx = ssl.create_default_context(cafile=str(tls / "tls.crt"))

            status, body, headers = _get(url, None, ctx)
            assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer"), (status, body)
            status, body, _ = _get(url, "not-a-token", ctx)
            assert status == 401 and "not valid" in body, (status, body)
            status, body, _ = _get(url, stranger, ctx)
            assert status == 403 and f"system:serviceaccount:{ns}:stranger" in body and "metrics-reader" in body, \
                (status, body)
            reviews = access.reviews
            status, body, _ = _get(url, reader, ctx)
            assert status == 200 and "embedops_operator_leader" in body, (status, body[:300])
            assert access.reviews == reviews + 1
            for _ in range(5):  # Prometheus' next scrapes: answered from the cache, no request to the API server
                assert _get(url, reader, ctx)[0] == 200
            assert access.reviews == reviews + 1
            # plain HTTP on the TLS port is refused, not answered in clear
            with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
            print(f"/metrics over HTTPS: no token 401, bad token 401, unbound ServiceAccount 403, metrics-reader 200; "
                  f"{access.reviews} TokenReviews for 9 requests")
        finally:
            if server is not None:
                server.shutdown()
                server.server_close()
            if operator_api is not None:
                operator_api.close()
            delete_cluster_scoped(api, rbac)
    api.close()
