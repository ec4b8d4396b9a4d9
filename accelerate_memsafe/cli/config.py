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

from ..errors import ConfigError, PipelineError
from ..plugin import MemSafePlugin
from .errors import CliError

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


def accepted_formats(name: str) -> str:
    """What an option accepts, as the CLI says it after a bad value.

    Example:
        >>> accepted_formats("bucket_bytes")
        'a byte count or a size, e.g. 67108864, 32MB, 64MiB, 1GiB'
    """
    hint = typing.get_type_hints(MemSafePlugin)[name]
    if name == "stages":
        from ..stages import STAGE_REGISTRY

        return f"stage names separated by commas, in run order, from: {', '.join(STAGE_REGISTRY)}"
    if name == "load_source":
        from ..distributed.local_read import LOAD_SOURCES

        return f"one of {', '.join(LOAD_SOURCES)}"
    if hint is bool:
        return "yes or no (or true/false, 1/0, on/off)"
    if hint is int:
        return "a byte count or a size, e.g. 67108864, 32MB, 64MiB, 1GiB" if _takes_a_size(name) else "a whole number, e.g. 2"
    if hint is float:
        return "a number, e.g. 600"
    return "text"


def _takes_a_size(name: str) -> bool:
    try:
        MemSafePlugin(**{name: "1KiB"})
    except (ConfigError, PipelineError):
        return False
    return True


def parse_option(name: str, raw: str, *, label: str) -> Any:
    """One option's value from text, checked on its own (a stage list: names and order).

    Args:
        name: The option.
        raw: What the user typed.
        label: How the user gave it, for the message (``--bucket-bytes``, or the option name when asked).

    Raises:
        CliError: Naming ``label``, the value and what the option accepts.
    """
    from ..plugin import _parse_env_value

    try:
        value = _parse_env_value(label, raw, typing.get_type_hints(MemSafePlugin)[name])
    except ConfigError:
        raise CliError(f"{label} {raw!r} is not accepted; use {accepted_formats(name)}.") from None
    try:
        MemSafePlugin(**{name: value})
    except PipelineError as exc:
        problems = "\n".join(f"  - {p}" for p in exc.problems)
        raise CliError(f"{label} {raw!r} is not a valid pipeline:\n{problems}") from None
    except ConfigError as exc:
        raise CliError(f"{label} {raw!r}: {exc} Use {accepted_formats(name)}.") from None
    return value


def settings_from_args(args: argparse.Namespace, ask=input, say=print) -> dict[str, Any]:
    """The option values given by flags, asking for the others unless ``--non-interactive``; a bad answer is
    explained (what the option accepts) and asked again.

    Raises:
        CliError: For a bad flag value, or when standard input ends before an answer.
    """
    values: dict[str, Any] = {}
    for f in MemSafePlugin.options():
        raw = getattr(args, f.name, None)
        if raw is not None:
            values[f.name] = parse_option(f.name, raw, label=_flag(f.name)) if isinstance(raw, str) else raw
            continue
        if args.non_interactive:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = ",".join(default) if isinstance(default, tuple) else default
        prompt = f"{f.name} [{'every stage' if f.name == 'stages' and default is None else shown}]: "
        while True:
            try:
                answer = ask(prompt).strip()
            except EOFError:
                raise CliError(f"no answer for `{f.name}` (standard input ended); give every value as a flag with "
                               "--non-interactive (see `accelerate-memsafe config --help`).") from None
            if not answer:
                break
            try:
                values[f.name] = parse_option(f.name, answer, label=f.name)
                break
            except CliError as exc:
                say(f"  {exc} Enter keeps the default.")
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
    try:
        path = write_config(values, args.output)
    except PipelineError as exc:  # each option was valid alone; together they are not
        problems = "\n".join(f"  - {p}" for p in exc.problems)
        raise CliError(f"the stage pipeline of these settings is not valid:\n{problems}") from None
    print(f"wrote {path}")
    return 0
