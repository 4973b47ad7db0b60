"""Operator upgrades that restart nothing: the pin each of a service's Deployments is rendered with.

A Deployment records its pin (render.Pin: template revision and image). Rendered again at that pin, the spec
gives the template the Deployment already runs unless the spec changed it; only then does it move to the
operator's latest revision and image (its pods roll anyway, and take the new defaults with them). Otherwise the
pin is kept, unless the operator's pod upgrades are set to Roll: then the move is an upgrade rollout, which the
reconciler paces (at most N services at a time).

Pure: the caller supplies how to render at a pin and how to compare a template with the live one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import render

CREATED, SPEC_CHANGED, CURRENT, KEPT, UPGRADE = "created", "spec-changed", "current", "kept", "upgrade"


@dataclass(frozen=True)
class Choice:
    pin: render.Pin  # what to render with now
    reason: str  # one of the constants above
    latest: render.Pin  # the operator's latest, resolved (its image is the one the latest render uses)


def image_of(deployment: dict) -> str | None:
    containers = deployment["spec"]["template"]["spec"].get("containers") or [{}]
    return containers[0].get("image")


def choose(render_at: Callable[[render.Pin], dict], live: dict | None,
           same_template: Callable[[dict, dict], bool]) -> Choice:
    """The pin for one Deployment. `render_at(pin)`: the Deployment manifest rendered at `pin`; `live`: the
    operator's own live Deployment (None when there is none yet); `same_template(desired, live)`: whether the
    desired manifest's pod template is the live one (used for Deployments written before templates recorded
    their hash)."""
    newest = render_at(render.Pin())
    latest = render.Pin(render.TEMPLATE_REVISION, image_of(newest))
    current = render.pinned(live)
    if current is None:
        return Choice(latest, CREATED, latest)
    if current == latest:
        return Choice(latest, CURRENT, latest)
    at_pin = render_at(current)
    recorded = ((live.get("metadata") or {}).get("annotations") or {}).get(render.ANNOTATION_TEMPLATE_HASH)
    if recorded is not None:
        unchanged = render.content_hash(at_pin["spec"]["template"]) == recorded
    else:
        unchanged = same_template(at_pin, live)
    if not unchanged:
        return Choice(latest, SPEC_CHANGED, latest)
    return Choice(current, KEPT, latest)


def describe(choice: Choice) -> str | None:
    """For the status: what a kept pin leaves out, None when the Deployment has the latest."""
    if choice.pin == choice.latest:
        return None
    parts = []
    if choice.pin.revision != choice.latest.revision:
        parts.append(f"template revision {choice.latest.revision} (runs {choice.pin.revision})")
    if choice.pin.image != choice.latest.image:
        parts.append(f"image {choice.latest.image} (runs {choice.pin.image})")
    return " and ".join(parts)
