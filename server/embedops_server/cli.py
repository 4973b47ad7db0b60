"""`embedops-server`: TEI's flag names and defaults (port 8080 here), each also read from UPPER_SNAKE env.

The flags are settings.Settings' fields; this module only presents them (argparse) and reports bad values."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterable, Mapping

from pydantic import ValidationError

from .settings import EnvironmentSettings, Settings, Tuning

# A flag's name is its field's, kebab-cased; its variable and default come from the model (settings.py).


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(flag: str) -> str:
    """The environment variable of an embedops-server flag (TEI's rule: the flag in upper snake case)."""
    return Settings.env_name(flag.lstrip("-").replace("-", "_"))


FLAGS = [flag_name(field) for field in Settings.model_fields]


def settings_parser(model: type[EnvironmentSettings], prog: str, description: str | None) -> argparse.ArgumentParser:
    """One flag per field of `model`, its help from the field's description; a flag given wins over the
    variable, which wins over the default (the model's sources, settings.py)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    for field, info in model.model_fields.items():
        default = info.default
        shown = "" if default in (None, "") or info.repr is False else f"; default {default}"
        help_ = f"{info.description} [env {model.env_name(field)}{shown}]"
        # values stay text here: the model converts and checks them, with the same rules as the variables'
        if info.annotation is bool:
            p.add_argument(flag_name(field), dest=field, nargs="?", const="true", default=argparse.SUPPRESS,
                           metavar="BOOL", help=help_)
        else:
            p.add_argument(flag_name(field), dest=field, default=argparse.SUPPRESS, metavar=field.upper(),
                           help=help_)
    return p


def load_settings(model: type[EnvironmentSettings], parser: argparse.ArgumentParser, argv: list[str] | None,
                  environ: Mapping[str, str] | None = None, required: Iterable[str] = ()):
    """The settings of `argv` and `environ` (default os.environ); a value that does not validate ends the
    process with the parser's usage and a line naming the flag or variable (exit 2), never a traceback."""
    flags = vars(parser.parse_args(argv))
    try:
        settings = model.from_environment(environ, **flags)
    except ValidationError as e:
        parser.error("; ".join(_describe(model, err, flags) for err in e.errors()))
    for field in required:
        if not getattr(settings, field):
            parser.error(f"{flag_name(field)} (or {model.env_name(field)}) is required")
    return settings


def _describe(model: type[EnvironmentSettings], err: dict, flags: dict) -> str:
    msg = err["msg"].removeprefix("Value error, ")
    field = next((str(x) for x in err["loc"][:1] if str(x) in model.model_fields), None)
    if field is None:  # a conflict between flags (the model's own check)
        return msg
    got = "" if model.model_fields[field].repr is False else f", got {err.get('input')!r}"  # never a secret
    if field in flags:
        return f"argument {flag_name(field)}: {msg}{got}"
    return f"environment variable {model.env_name(field)}: {msg}{got}"


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    parser = settings_parser(Settings, "embedops-server", __doc__)
    settings = load_settings(Settings, parser, argv, environ, required=("model_id",))
    try:  # the backends read the EMBEDOPS_* switches when they are built: a bad one is refused here, at once
        Tuning.from_environment(environ)
    except ValidationError as e:
        parser.error("; ".join(_describe(Tuning, err, {}) for err in e.errors()))
    return settings


def setup_logging(s: Settings) -> None:
    level = getattr(logging, s.log_level.upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    if s.json_output:
        from .logs import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Everything goes through this handler, so --json-output yields only JSON lines: Python warnings too,
    # and no progress bars from transformers / huggingface_hub.
    logging.captureWarnings(True)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
        tlog.disable_default_handler()
        tlog.enable_propagation()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> None:
    """`embedops-server [flags]` serves; `embedops-server prepare [flags]` (the same flags) makes the ONNX
    cache entry those flags need (export, int8 and its gate, fused graph) and exits (prepare.py)."""
    # Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning, leaving the cores to the
    # tokenizers and the event loop (measured on 2 shared cores: ~2x saturated torch-CPU throughput).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare"]:
        s = parse_args(argv[1:])
        setup_logging(s)
        from .prepare import main as prepare_main

        sys.exit(prepare_main(s, Tuning.from_environment()))  # the switches, read once (checked by parse_args)
    s = parse_args(argv)
    setup_logging(s)
    # Settings' repr hides api_key; log it as a boolean only.
    logging.getLogger("embedops_server").info("starting with %r (api key set: %s)", s, bool(s.api_key))
    from .router.server import serve

    serve(s, Tuning.from_environment())  # the EMBEDOPS_* switches, read once (checked by parse_args)


if __name__ == "__main__":
    main()
