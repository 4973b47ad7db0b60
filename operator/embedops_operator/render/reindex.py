"""The reindex Job of a migration (spec.migration.reindex)."""
from __future__ import annotations

import json
from typing import Any

from ..spec import EmbeddingServiceSpec
from .base import LABEL_COMPONENT, LABEL_SPACE, common_labels, content_hash, detect_task, object_meta


def reindex_job(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, env: dict[str, str]) -> dict:
    """The user's reindex Job for a new embedding space (spec.migration.reindex): its pod template as given, each
    container with the space's environment (EMBEDOPS_SPACE, _URL, _FINGERPRINT, EMBEDOPS_PREVIOUS_SPACE, _URL). A
    Job's template cannot change: its name carries the space and a hash of the template, so an edit runs a new Job
    (the old one is pruned)."""
    reindex = spec.migration.reindex
    assert reindex is not None
    template = json.loads(json.dumps(reindex.template))
    pod = template.setdefault("spec", {})
    pod.setdefault("restartPolicy", "Never")
    # no token of the namespace's default account (issue 53): only an account the template names may mount one
    if not pod.get("serviceAccountName"):
        pod["automountServiceAccountToken"] = False
    extra = [{"name": k, "value": v} for k, v in sorted(env.items())]
    for c in pod.get("containers") or []:
        c["env"] = [e for e in c.get("env") or [] if e.get("name") not in env] + extra
    digest = reindex_digest(spec)
    job_spec: dict[str, Any] = {"backoffLimit": reindex.backoff_limit, "template": template}
    if reindex.active_deadline_seconds:
        job_spec["activeDeadlineSeconds"] = reindex.active_deadline_seconds
    labels = {**common_labels(name, detect_task(spec.model)), LABEL_COMPONENT: "reindex", LABEL_SPACE: env["EMBEDOPS_SPACE"]}
    template.setdefault("metadata", {}).setdefault("labels", {}).update(
        {LABEL_COMPONENT: "reindex", LABEL_SPACE: env["EMBEDOPS_SPACE"]})
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": object_meta(reindex_job_name(name, env["EMBEDOPS_SPACE"], digest), ns, labels, owner),
            "spec": job_spec}


def reindex_digest(spec: EmbeddingServiceSpec) -> str:
    r = spec.migration.reindex
    assert r is not None
    return content_hash([r.template, r.backoff_limit, r.active_deadline_seconds])[:4]


def reindex_job_name(name: str, key: str, digest: str) -> str:
    return f"{name[:36]}-reindex-{key}-{digest}"


