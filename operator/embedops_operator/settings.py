"""The operator's settings: every option, its `EMBEDOPS_*` variable and its default declared once.

The chart sets the variables (charts/embedops-operator/templates/deployment.yaml); `embedops-operator run`'s flags
(`--namespace`, `--resync-seconds`, `--stall-after-seconds`) override theirs. The process reads them once at
start and hands the object to the controller (handlers.configure): nothing reads the environment per reconcile.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# A list of namespaces as the chart writes it: comma- (or space-) separated text, not JSON.
Namespaces = Annotated[tuple[str, ...], NoDecode]
NAMESPACE_LISTS = ("namespaces", "gateway_namespaces", "prometheus_namespaces", "keda_namespaces")


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EMBEDOPS_", env_ignore_empty=True, extra="ignore", frozen=True)

    namespaces: Namespaces = Field((), description="namespaces to watch; empty: all")
    resync_seconds: float = Field(60.0, gt=0, description="seconds between full re-reconciles of every service")
    stall_after_seconds: float = Field(60.0, gt=0, description="seconds a pod may stay unschedulable or failing "
                                       "before the service reports Stalled")
    server_image_cpu: str = Field("ghcr.io/embedops/embedops-server:0.1.0-cpu",
                                  description="the server image of CPU services")
    server_image_cuda: str = Field("ghcr.io/embedops/embedops-server:0.1.0-cuda",
                                   description="the server image of GPU services")
    cluster_domain: str = Field("cluster.local", description="the cluster's DNS domain (service addresses)")
    tracing_endpoint: str | None = Field(None, description="the OTLP/gRPC endpoint services without spec.tracing "
                                         "export their traces to (default: none, no tracing)")
    # Running services whose spec did not change: "Keep" their pods as they are across operator upgrades (a new
    # server image or template revision waits for their next spec change), or "Roll" them to it, at most
    # `max_concurrent_upgrades` services at a time, each Ready before the next starts (reconcile.py)
    pod_upgrades: Literal["Keep", "Roll"] = Field("Keep", description="Keep | Roll: running services' pods across "
                                                  "operator upgrades")
    max_concurrent_upgrades: int = Field(1, ge=1, description="services rolled at once under pod_upgrades Roll")
    # The operator's own bound on its request rate to the API server (client-go's token bucket; kube-controller-
    # manager's --kube-api-qps/--kube-api-burst): a fleet's roll-out queues in the operator instead of slowing
    # everyone else's kubectl. Watches are not counted; 0 turns the bound off (docs/operator.md "Sizing")
    kube_api_qps: float = Field(50.0, ge=0, description="requests a second to the API server, on average (0: "
                                "no bound)")
    kube_api_burst: int = Field(100, ge=1, description="requests to the API server at once above kube_api_qps")
    # Where the platform's callers run, for services with spec.networkPolicy (the chart's networkPolicy.*): the
    # gateway's pods (admitted when the service has a route), Prometheus' (when it has a ServiceMonitor) and
    # KEDA's operator (the scale-from-zero demand on the activator's admin port)
    gateway_namespaces: Namespaces = Field((), description="the gateway's namespaces")
    prometheus_namespaces: Namespaces = Field((), description="Prometheus' namespaces")
    keda_namespaces: Namespaces = Field((), description="KEDA operator's namespaces")

    @field_validator(*NAMESPACE_LISTS, mode="before")
    @classmethod
    def namespace_list(cls, value: Any) -> Any:
        """Sorted and without duplicates, from text (commas or spaces) or a sequence."""
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        return tuple(sorted({str(n).strip() for n in value if str(n).strip()}))

    @field_validator("pod_upgrades", mode="before")
    @classmethod
    def policy_in_any_case(cls, value: Any) -> Any:
        return value.strip().capitalize() if isinstance(value, str) else value

    @classmethod
    def env_name(cls, field: str) -> str:
        return (cls.model_config["env_prefix"] + field).upper()
