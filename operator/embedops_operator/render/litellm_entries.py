"""The LiteLLM model entries of a service (a ConfigMap the in-cluster proxy reads)."""
from __future__ import annotations

from jinja2 import Environment, StrictUndefined

from ..spec import EmbeddingServiceSpec
from .base import (
    LABEL_LITELLM, Options, batch_service_name, detect_task, has_batch_service, served_model_name, service_url)

_LITELLM = Environment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False).from_string(
    """# Managed by embedops for EmbeddingService {{ namespace }}/{{ name }}; merge into LiteLLM's model_list.
model_list:
{%- for entry_name, base in entries %}
- model_name: {{ entry_name | tojson }}
  litellm_params:
{%- if task == "rerank" %}
    model: {{ ("huggingface/" ~ served) | tojson }}
    api_base: {{ base | tojson }}
{%- else %}
    model: {{ ("openai/" ~ served) | tojson }}
    api_base: {{ (base ~ "/v1") | tojson }}
{%- endif %}
    api_key: {{ api_key | tojson }}
  model_info:
    mode: {{ "rerank" if task == "rerank" else "embedding" }}
{%- endfor %}
""")


def litellm_key(name: str) -> str:
    return f"embedops-{name}.yaml"


def litellm_config_map(name: str, ns: str, spec: EmbeddingServiceSpec, options: Options,
                       spaces: tuple[tuple[str, str], ...] = ()) -> dict:
    """This service's entries in the shared LiteLLM ConfigMap (one data key per service, own field manager): its
    model name at the service's address, `<model name>-batch` at the batch lane's (lanes.batchService), and during
    a change of the embedding space (`spaces`: (key, track) of
    each running one) one alias per space, `<model name>@<key>`, at that space's own address, so a query path or
    a reindex job can ask for one space by name whichever serves the service's address.

    No owner reference: the ConfigMap is shared and may be the user's; litellm.py removes stale keys.
    """
    from ..spaces import space_service_name

    ll = spec.litellm
    assert ll is not None
    served = served_model_name(spec)
    model_name = ll.model_name or served
    entries = [(model_name, service_url(name, ns, spec, options))] + [
        (f"{model_name}@{key}", service_url(space_service_name(name, key), ns, spec, options)) for key, _ in spaces]
    if has_batch_service(spec):  # ingestion through the gateway, in the batch lane
        entries.append((f"{model_name}-batch", service_url(batch_service_name(name), ns, spec, options)))
    env_name = "EMBEDOPS_" + "".join(c if c.isalnum() else "_" for c in name.upper()) + "_API_KEY"
    text = _LITELLM.render(namespace=ns, name=name, entries=entries, served=served, task=detect_task(spec.model),
                           api_key=f"os.environ/{env_name}" if spec.api_key_secret_ref else "none")
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": ll.config_map_name, "namespace": ns, "labels": {LABEL_LITELLM: "true"}},
            "data": {litellm_key(name): text}}

