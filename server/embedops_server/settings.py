"""The server's and the activator's settings: each flag, its environment variable and its default declared once.

Three pydantic-settings models. `Settings` (embedops-server) and `ActivatorSettings` (embedops-activator) are
what their command lines set: TEI's flag names, each also read from its upper-snake environment variable (the
flag `--max-batch-tokens`, the variable `MAX_BATCH_TOKENS`); cli.py turns every field into a flag, so a field's
type, default, bounds and help text are the whole definition. `Tuning` holds the engine's measured switches
(`EMBEDOPS_*`, environment only): they exist to compare a choice side by side, not to configure a service, so
they have no flags; each backend reads them when it is built.

A value that does not validate is a clear error naming the flag or the variable (cli.py), never a traceback.
"""
from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from . import sizing

# The environment a settings model reads: os.environ, unless `from_environment` names another mapping (tests,
# and the operator's check that every flag it renders parses).
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("embedops_settings_environ", default=None)


class ProcessEnvironment(EnvSettingsSource):
    """The process environment (or the mapping `from_environment` was given), read as pydantic-settings reads it;
    a variable set to the empty string counts as unset, as it always has for these flags."""

    def __init__(self, settings_cls: type[BaseSettings]):
        super().__init__(settings_cls)
        environ = _ENVIRON.get()
        if environ is not None:
            self.env_vars = parse_env_vars(environ, self.case_sensitive, self.env_ignore_empty,
                                           self.env_parse_none_str)

    def __call__(self) -> dict[str, Any]:
        values = super().__call__()
        for name in getattr(self.settings_cls, "IP_ONLY_VARIABLES", ()):
            # Docker and Kubernetes set HOSTNAME to the container's or pod's name: only an address counts.
            if name in values and not _is_ip(values[name]):
                del values[name]
        for name in getattr(self.settings_cls, "NUMBER_ONLY_VARIABLES", ()):
            # Kubernetes' service links set <SERVICE>_PORT=tcp://<ip>:<port> in every pod of the namespace: a
            # Service named prometheus sets PROMETHEUS_PORT. Only a number counts.
            if name in values and not str(values[name]).strip().isdigit():
                del values[name]
        return values


def _is_ip(text: Any) -> bool:
    try:
        ipaddress.ip_address(str(text))
        return True
    except ValueError:
        return False


class EnvironmentSettings(BaseSettings):
    """A settings model read from the init arguments (the flags), then the environment, then its defaults;
    never from .env or secret files."""

    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore")
    # variables read only when they hold an IP address (ProcessEnvironment)
    IP_ONLY_VARIABLES: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource):
        return init_settings, ProcessEnvironment(settings_cls)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, **values: Any):
        """The settings from `values` (what the flags said), else `environ` (default: os.environ), else defaults."""
        token = _ENVIRON.set(os.environ if environ is None else environ)
        try:
            return cls(**values)
        finally:
            _ENVIRON.reset(token)

    @field_validator("api_key", check_fields=False)
    @classmethod
    def key_without_whitespace(cls, value: str | None) -> str | None:
        """A key read with a trailing newline (a Secret written by `echo`) matches no client's bearer token: every
        request would be 401 while /health says 200. Refused at start (issue 53), by the server and the activator."""
        if value and value != value.strip():
            raise ValueError("the API key has leading or trailing whitespace (a Secret written with a newline?): "
                             "no client's bearer token would match it; remove it from the Secret")
        return value

    @classmethod
    def env_name(cls, field: str) -> str:
        """The environment variable of a field: its name in upper snake case, after the model's prefix."""
        return (cls.model_config.get("env_prefix", "") + field).upper()


class Settings(EnvironmentSettings):
    """embedops-server's flags (TEI's names and defaults; port 8080 here)."""

    IP_ONLY_VARIABLES: ClassVar[tuple[str, ...]] = ("hostname",)
    NUMBER_ONLY_VARIABLES: ClassVar[tuple[str, ...]] = ("prometheus_port",)

    model_id: str = Field("", description="local model folder (Hugging Face layout)")
    revision: str = Field("main", description="hub revision (branch, tag or commit) looked up in the Hugging Face "
                          "cache; /info reports the commit served as model_sha")
    pinned_revision: str | None = Field(
        None, pattern=r"^[0-9a-f]{40}$", description="the commit to load instead of --revision's: the one the first "
        "replica of this embedding space resolved, so that every later replica loads the same weights (the "
        "operator sets it from a ConfigMap; unset: --revision)")
    pooling: str | None = Field(None, description="cls | mean | splade | last-token (default: from "
                                "1_Pooling/config.json)")
    dtype: Literal["float32", "float16", "bfloat16"] | None = Field(
        None, description="float32 | float16 | bfloat16 (default: float16 on CUDA, float32 on CPU)")
    backend: Literal["auto", "torch", "onnxruntime", "ort", "onnx", "hybrid"] = Field(
        "auto", description="auto | torch | onnxruntime | hybrid (auto: torch on CUDA or for a float16/bfloat16 "
        "dtype, else ONNX Runtime for every task; hybrid: CPU, ONNX Runtime for inputs up to 128 tokens, torch "
        "for longer)")
    device: str | None = Field(None, description="cpu | cuda | cuda:N (default: cuda when available)")
    quantize: Literal["int8"] | None = Field(
        None, description="int8: ONNX Runtime dynamic per-channel int8, refused below --int8-min-cosine")
    int8_min_cosine: float = Field(0.98, ge=0.0, le=1.0,
                                   description="minimum cosine vs float32 on the check sentences for int8")
    max_batch_tokens: int = Field(16384, ge=1, description="token budget per forward batch (padded: longest x "
                                  "count)")
    max_forward_tokens: int | None = Field(
        None, ge=0, description="padded tokens per forward pass (default: the backend's efficient size on CPU, ONNX "
        "Runtime 256 with two forwards side by side, else 1024, torch 2048; unlimited on CUDA); 0 = up to "
        "--max-batch-tokens")
    max_input_length: int | None = Field(
        None, ge=1, description="longest input in tokens (default: the model's); longer inputs are truncated or "
        "refused, and the start-up warm-up runs one input of this length: it bounds the attention memory a replica "
        "needs")
    max_batch_requests: int | None = Field(None, ge=1, description="maximum inputs per forward batch")
    max_concurrent_requests: int = Field(512, ge=1, description="admitted inputs in flight before answering 429")
    max_client_batch_size: int = Field(32, ge=1, description="maximum inputs per request")
    max_embed_all_tokens: int = Field(sizing.EMBED_ALL_TOKENS, ge=1, description="tokens of one /embed_all request (its answer holds "
                                      "tokens x hidden size floats); more is refused with 422 before any forward")
    max_token_answers: int = Field(sizing.RESPONSES_IN_FLIGHT, ge=1, description="answers of every token's state (/embed_all, bge-m3's "
                                   "ColBERT vectors) in progress at once, from admission until sent; one more is "
                                   "answered 429: what the memory estimate counts (sizing.RESPONSES_IN_FLIGHT)")
    answer_cache_bytes: int = Field(0, ge=0, description="an exact-match cache of answers (embeddings, sparse "
                                    "vectors, scores) bounded by this many bytes, least recently used out: a "
                                    "repeated input is answered without a forward, tokenization or admission; keyed "
                                    "by the input after its prompt and the truncation (one process serves one "
                                    "embedding space); 0 = off")
    lanes: bool = Field(True, description="interactive and batch lanes: a query's inputs do not wait behind "
                        "ingestion's (docs/server.md#lanes); false = one FIFO queue, as TEI")
    default_lane: Literal["auto", "interactive", "batch"] = Field(
        "auto", description="the lane of a request whose client does not send an `embedops-lane` header; auto = "
        "interactive for a request of at most --lane-auto-max-inputs inputs and for /rerank, batch otherwise")
    lane_auto_max_inputs: int = Field(4, ge=0, le=1 << 20, description="largest request (inputs) that "
                                      "--default-lane auto puts in the interactive lane")
    batch_lane_share: float = Field(0.75, ge=0.01, le=1.0, description="share of --max-concurrent-requests the "
                                    "batch lane may hold in flight: past it batch requests get 429 while "
                                    "interactive ones are still admitted")
    batch_port: int = Field(0, ge=0, le=65535, description="a second port for the same API whose requests default "
                            "to the batch lane (an address for ingestion jobs: the operator's <name>-batch "
                            "Service); 0 = none")
    batch_lane_nice: int = Field(10, ge=0, le=19, description="nice value of the batch lane's inference threads "
                                 "where the lanes run side by side (ONNX Runtime on CPU); 0 = the same priority as "
                                 "queries")
    auto_truncate: bool = Field(True, description="truncate over-long inputs when the request does not say")
    tokenization_workers: int | None = Field(None, ge=1, description="tokenizer threads (default: CPUs - 1, at "
                                             "least 1)")
    num_threads: int | None = Field(None, ge=1, description="intra-op threads for inference (default: CPUs "
                                    "allowed by cgroup)")
    default_prompt: str | None = Field(None, description="prefix added to every input")
    default_prompt_name: str | None = Field(None, description="key of `prompts` in "
                                            "config_sentence_transformers.json")
    served_model_name: str | None = Field(None, description="model name reported by the OpenAI routes")
    # never printed: Settings' repr leaves it out, and the start-up log says only whether it is set
    api_key: str | None = Field(None, repr=False, description="require `Authorization: Bearer <key>` on "
                                "inference routes")
    payload_limit: int = Field(2_000_000, ge=1, description="maximum request body in bytes")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="request line and header fields in bytes (431 "
                                  "beyond)")
    max_headers: int = Field(100, ge=1, description="header fields per request (431 beyond)")
    request_timeout: float = Field(30.0, gt=0, description="seconds to receive a whole request, headers and body, "
                                   "from its first byte or the connection's start (408 and the connection closed "
                                   "beyond): a slow client holds no connection or admission slot for long")
    max_connections: int = Field(2048, ge=1, description="open connections (requests included) before a new "
                                 "request is answered 503")
    hostname: str = Field("0.0.0.0", description="address to bind (the variable HOSTNAME counts only when it is "
                          "an IP address: Kubernetes sets it to the pod's name)")
    port: int = Field(8080, ge=0, le=65535, description="port for the API, /health and /metrics")
    graceful_shutdown_timeout: float = Field(30.0, ge=0, description="seconds to finish in-flight requests after "
                                             "SIGTERM")
    max_connection_age: float = Field(
        0.0, ge=0, description="seconds after which a keep-alive connection is closed after its next answer "
        "(Connection: close), so clients follow the Service to new pods (a promoted embedding space, added "
        "replicas); 0 = never")
    onnx_cache: str | None = Field(None, description="where ONNX exports and int8 models are written (default "
                                   "$EMBEDOPS_CACHE or ~/.cache/embedops)")
    log_level: str = Field("info", description="debug | info | warning | error")
    json_output: bool = Field(False, description="JSON logs")
    outputs: str | None = Field(None, description="comma-separated outputs the model must give (dense, sparse, "
                                "colbert: bge-m3's heads); the server refuses to start when one is missing instead "
                                "of answering 424 per request")
    cors_allow_origin: str | None = Field(None, description="browser origins allowed to call the API "
                                          "(comma-separated, or *); preflights allow Authorization as well as "
                                          "Content-Type. Default: no CORS headers")
    # TEI's remaining flags (issue 54): the same names and variables, so a TEI command line starts embedops
    hf_token: str | None = Field(None, repr=False, description="Hugging Face token for a gated or private hub model "
                                 "(default: huggingface_hub's own, HF_TOKEN or its token file)")
    hf_api_token: str | None = Field(None, repr=False, description="the deprecated name of --hf-token (TEI's)")
    huggingface_hub_cache: str | None = Field(None, description="the Hugging Face hub cache a hub model is read from "
                                              "and downloaded into (default: huggingface_hub's, under HF_HOME)")
    dense_path: str | None = Field(None, description="the sentence-transformers Dense module folder, relative to the "
                                   "model's (e.g. 2_Dense_256), used instead of the ones modules.json names; it is "
                                   "part of the embedding space")
    prometheus_port: int | None = Field(None, ge=1, le=65535, description="serve /metrics on this port, and not on "
                                        "--port: a Service or NetworkPolicy can expose the API without the metrics "
                                        "(default: on --port, as TEI's HTTP build, which ignores this flag)")
    otlp_endpoint: str | None = Field(None, description="export a trace span per request, with its stages (parse, "
                                      "tokenize, queue, slot, forward, wake, respond), to this OpenTelemetry "
                                      "collector: OTLP over gRPC (e.g. http://otel-collector:4317), or HTTP with "
                                      "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf; a caller's traceparent is honoured. "
                                      "Default: no tracing")
    otlp_service_name: str = Field("text-embeddings-inference.server", description="the service.name of the spans "
                                   "(TEI's default)")
    disable_spans: bool = Field(False, description="accepted for TEI's command lines: the JSON logs carry no spans")
    uds_path: str | None = Field(None, description="accepted for TEI's command lines: TEI's socket to its Python "
                                 "backend; the model runs in this process")

    @property
    def token(self) -> str | None:
        """--hf-token, else its deprecated name."""
        return self.hf_token or self.hf_api_token

    @property
    def model_revision(self) -> str:
        """What the model is loaded at: the pinned commit, else --revision."""
        return self.pinned_revision or self.revision

    @field_validator("max_forward_tokens", "max_input_length", "max_batch_requests", "tokenization_workers",
                     "num_threads", "dtype", "quantize", "pinned_revision", mode="before")
    @classmethod
    def none_means_default(cls, value: Any) -> Any:
        """`none` (or an empty value) on the command line means the default None, as TEI's optional flags do."""
        return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value


    @field_validator("default_lane", mode="before")
    @classmethod
    def lane_in_any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def refuse_conflicts(self) -> "Settings":
        """Flags that contradict each other whatever the model: refused before anything loads."""
        if self.default_prompt and self.default_prompt_name:
            raise ValueError("--default-prompt and --default-prompt-name are mutually exclusive")
        if self.quantize and self.backend in ("torch", "hybrid"):
            raise ValueError(f"--quantize {self.quantize} is only supported with the ONNX Runtime backend")
        if self.backend in ("onnxruntime", "ort", "onnx") and self.dtype not in (None, "float32"):
            raise ValueError("the ONNX Runtime backend runs float32 (or --quantize int8)")
        if self.backend == "hybrid" and ((self.device or "cpu") != "cpu" or self.dtype not in (None, "float32")):
            raise ValueError("--backend hybrid is CPU float32 only (ONNX Runtime for short inputs, torch for long)")
        # a request the server could never admit would be answered 429 (retry later) forever: refused here instead
        c, m = self.max_client_batch_size, self.max_concurrent_requests
        if c > m:
            raise ValueError(f"--max-client-batch-size {c} > --max-concurrent-requests {m}: a request of {m + 1}-{c} "
                             "inputs could never be admitted (429 forever); lower the one or raise the other")
        if self.lanes and c > self.batch_lane_limit:
            raise ValueError(f"--max-client-batch-size {c} > the batch lane's limit {self.batch_lane_limit} "
                             f"(--max-concurrent-requests {m} x --batch-lane-share {self.batch_lane_share}): a batch "
                             f"request of {self.batch_lane_limit + 1}-{c} inputs could never be admitted (429 "
                             "forever); lower --max-client-batch-size, raise the others, or --lanes false")
        if self.prometheus_port and self.prometheus_port in (self.port, self.batch_port):
            raise ValueError(f"--prometheus-port {self.prometheus_port} is the API's port: give the metrics a port "
                             "of their own, or leave it unset to serve them on --port")
        return self

    @property
    def batch_lane_limit(self) -> int:
        """Inputs the batch lane may hold in flight (core/lanes.py)."""
        return max(1, int(self.max_concurrent_requests * self.batch_lane_share))


class ActivatorSettings(EnvironmentSettings):
    """embedops-activator's flags: the scale-from-zero proxy in front of a service's model pods."""

    IP_ONLY_VARIABLES: ClassVar[tuple[str, ...]] = ("hostname",)

    backend: str = Field("", description="the model pods' Service, e.g. "
                         "http://minilm-backend.ns.svc.cluster.local")
    hostname: str = Field("0.0.0.0", description="address to bind (the variable HOSTNAME counts only when it is an "
                          "IP address)")
    port: int = Field(8080, ge=0, le=65535, description="the proxied port")
    admin_port: int = Field(9091, ge=0, le=65535, description="/healthz, /demand (KEDA's metrics-api trigger) and "
                            "/metrics")
    activation_timeout: float = Field(300.0, gt=0, description="seconds a request is held for a replica before 503 "
                                      "(cover a model load)")
    activity_window: float = Field(10.0, gt=0, description="seconds a request counts as demand after it started "
                                   "(at least KEDA's polling interval)")
    retry_interval: float = Field(0.25, gt=0, description="seconds between attempts to reach a replica")
    request_timeout: float = Field(600.0, gt=0, description="seconds to wait for a replica's answer once the "
                                   "request reached it (then 504)")
    max_body_bytes: int = Field(2_000_000, ge=1, description="the server's payload limit (413 beyond)")
    max_in_flight: int = Field(128, ge=1, description="requests held or forwarded at once (429 beyond); with the "
                               "body limit, its memory bound")
    max_held: int = Field(64, ge=1, description="requests waiting for a replica at once (429 beyond)")
    api_key: str | None = Field(None, repr=False, description="the bearer token the model pods require (sent on "
                                "the activator's own readiness probes)")


class Tuning(EnvironmentSettings):
    """The engine's measured switches (docs/server.md): `EMBEDOPS_<NAME>` variables, no flags. Each default is the
    choice a side-by-side measurement kept; the switch exists to repeat that comparison."""

    model_config = SettingsConfigDict(env_prefix="EMBEDOPS_")

    fast_path: bool = Field(True, description="the embedding routes without FastAPI's machinery (router/fast_path.py)")
    termination_log: str = Field("/dev/termination-log", description="where a failed start writes its reason "
                                 "(Kubernetes shows it as the container's termination message)")
    cache: str | None = Field(None, description="the ONNX cache when --onnx-cache is not given (default "
                              "~/.cache/embedops)")
    torch_single_thread_tokens: int = Field(64, ge=0, description="CPU torch forwards up to this many padded "
                                            "tokens run on one thread")
    cuda_graphs: bool = Field(True, description="replay small CUDA batches from captured graphs")
    ort_small_tokens: int = Field(64, ge=0, description="padded tokens up to which a forward runs on the spinning "
                                  "latency session (0: no such session)")
    inline_forward: bool = Field(True, description="a lone query's small forward runs on the event loop's thread")
    ort_parallel: bool = Field(True, description="two forwards side by side under load (small models, 2+ threads)")
    ort_wide_alone: bool | None = Field(None, description="a forward that started alone is not joined by a narrow "
                                        "one (default: float32 yes, int8 no)")
    ort_fuse: bool = Field(True, description="the latency session runs the fused graph when it agrees")
    ort_spin: bool = Field(False, description="ONNX Runtime's threads spin-wait between parallel sections")
    ort_arena: bool = Field(False, description="ONNX Runtime's CPU memory arena")
