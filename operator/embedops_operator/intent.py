"""What one reconcile works from: the EmbeddingService as read, parsed and validated once, with the facts derived
from its spec computed once (its task, owner reference, whether it scales to zero, its sizing) and the options
of this reconcile. The reconciler hands it to its steps instead of re-parsing the manifest in each; render and
status take its parsed spec too (`parsed=`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from . import memory, render
from .spec import EmbeddingService, EmbeddingServiceSpec, parse as parse_resource


@dataclass(frozen=True)
class Intent:
    resource: dict  # the object as read (metadata and status included)
    es: EmbeddingService  # parsed once; a manifest that does not parse never becomes an Intent
    options: render.Options

    @classmethod
    def of(cls, resource: dict, options: render.Options) -> "Intent":
        """Raises pydantic's ValidationError for a spec the operator cannot read (the status says why)."""
        return cls(resource, parse_resource(resource), options)

    @property
    def spec(self) -> EmbeddingServiceSpec:
        return self.es.spec

    @property
    def name(self) -> str:
        return self.resource["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.resource["metadata"]["namespace"]

    @property
    def uid(self) -> str | None:
        return self.resource["metadata"].get("uid")

    @property
    def status(self) -> dict:
        """The status as read (what the last reconcile wrote)."""
        return self.resource.get("status") or {}

    @cached_property
    def task(self) -> str:
        return render.detect_task(self.spec.model)

    @cached_property
    def owner(self) -> dict | None:
        return render.owner_reference(self.resource)

    @cached_property
    def scales_to_zero(self) -> bool:
        return render.scales_to_zero(self.spec, self.options)

    @cached_property
    def sizing(self) -> memory.Sizing | None:
        return render.sizing_of(self.spec)
