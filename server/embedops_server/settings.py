"""Server settings: one dataclass filled by the CLI (flags or upper-snake environment variables)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Settings:
    model_id: str = ""
    revision: str = "main"
    pooling: str | None = None
    dtype: str | None = None
    backend: str = "auto"  # auto | torch | onnxruntime
    device: str | None = None  # cpu | cuda[:N]; default: cuda when available
    quantize: str | None = None  # None | int8 (ONNX Runtime only; quality-gated)
    int8_min_cosine: float = 0.98
    max_batch_tokens: int = 16384
    max_batch_requests: int | None = None
    max_forward_tokens: int | None = None  # None: the backend's preferred size (CPU); 0: max_batch_tokens
    max_input_length: int | None = None  # None: the model's own limit; lower bounds attention memory
    max_concurrent_requests: int = 512
    max_client_batch_size: int = 32
    lanes: bool = True  # interactive and batch lanes (core/lanes.py)
    default_lane: str = "auto"  # auto | interactive | batch
    lane_auto_max_inputs: int = 4
    batch_lane_share: float = 0.75  # of max_concurrent_requests
    batch_lane_nice: int = 10
    batch_port: int = 0  # a second port whose requests default to the batch lane; 0: none
    auto_truncate: bool = True
    tokenization_workers: int | None = None
    num_threads: int | None = None
    default_prompt: str | None = None
    default_prompt_name: str | None = None
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)  # never printed
    payload_limit: int = 2_000_000
    hostname: str = "0.0.0.0"
    port: int = 8080
    json_output: bool = False
    graceful_shutdown_timeout: float = 30.0
    max_connection_age: float = 0.0  # seconds; 0: keep-alive connections live as long as the client keeps them
    onnx_cache: str | None = None
    cors_allow_origin: str | None = None  # comma-separated origins or "*"; None: no CORS headers
    outputs: str | None = None  # comma-separated outputs the model must have (dense, sparse, colbert)
    log_level: str = "info"
