"""``accelerate-memsafe config``: write the plugin's settings to a YAML file (interactive or by flags).

Accelerate's own YAML rejects unknown top-level keys and drops unknown ``fsdp_config`` keys, so the
plugin carries its own file; ``accelerate-memsafe launch --memsafe_config FILE`` turns it into
``ACCELERATE_MEMSAFE_*`` variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..plugin import MemSafePlugin

DEFAULT_FILE = "memsafe_config.yaml"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_parser(sub) -> None:
    p = sub.add_parser("config", help="write the plugin's settings to a YAML file")
    p.add_argument("--non-interactive", action="store_true", help="take every value from the flags (default: ask)")
    p.add_argument("-o", "--output", default=DEFAULT_FILE, help=f"file to write (default: {DEFAULT_FILE})")
    hints = typing.get_type_hints(MemSafePlugin)
    for f in MemSafePlugin.options():
        doc = _field_doc(f.name)
        if hints[f.name] is bool:
            p.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=doc)
        else:
            p.add_argument(_flag(f.name), dest=f.name, default=None, help=doc)
    p.set_defaults(run=run)


def _field_doc(name: str) -> str:
    from ..docs_index import option_docs

    return option_docs().get(name, "")


def _coerce(name: str, raw: Any) -> Any:
    from ..plugin import _parse_env_value

    if raw is None or not isinstance(raw, str):
        return raw
    return _parse_env_value(_flag(name), raw, typing.get_type_hints(MemSafePlugin)[name])


def settings_from_args(args: argparse.Namespace, ask=input) -> dict[str, Any]:
    """The option values given by flags, asking for the others unless ``--non-interactive``."""
    values: dict[str, Any] = {}
    for f in MemSafePlugin.options():
        raw = getattr(args, f.name, None)
        if raw is None and not args.non_interactive:
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = ",".join(default) if isinstance(default, tuple) else default
            answer = ask(f"{f.name} [{'every stage' if f.name == 'stages' and default is None else shown}]: ").strip()
            raw = answer or None
        if raw is not None:
            values[f.name] = _coerce(f.name, raw)
    return values


def write_config(values: dict[str, Any], path: str | Path) -> Path:
    """Validates ``values`` by building a :class:`MemSafePlugin`, then writes them as YAML."""
    import yaml

    plugin = MemSafePlugin(**values)  # raises PipelineError / ConfigError before anything is written
    data = {}
    for f in MemSafePlugin.options():
        if f.name in values:
            v = getattr(plugin, f.name)
            data[f.name] = list(v) if isinstance(v, tuple) else v
    path = Path(path)
    path.write_text(yaml.safe_dump({"memsafe": data}, sort_keys=False))
    return path


def read_config(path: str | Path) -> MemSafePlugin:
    """Reads a file written by ``accelerate-memsafe config``.

    Raises:
        ConfigError: If the file is missing, not YAML, or has unknown keys.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"memsafe config {path} does not exist; create it with `accelerate-memsafe config -o {path}`.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"memsafe config {path} is not valid YAML: {exc}") from None
    section = data.get("memsafe", data) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f"memsafe config {path} must hold a mapping under `memsafe:`.")
    known = {f.name for f in MemSafePlugin.options()}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"memsafe config {path} has unknown key(s) {unknown}; known keys: {sorted(known)}.")
    return MemSafePlugin(**section)


def run(args: argparse.Namespace) -> int:
    values = settings_from_args(args)
    path = write_config(values, args.output)
    print(f"wrote {path}")
    return 0
