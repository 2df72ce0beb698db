"""Each routing policy's config as flags of its own (``--kv-backlog-weight 6``), for ``kvledger up`` and ``bench``.

A policy's flags are its config dataclass's fields, prefixed with its name; an option given for a policy the
command does not run is an error rather than silently ignored.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvledger.launch.flags import DataclassFlags, add_dataclass_flags
from kvledger.router.policies import policy_config_type, policy_names


@dataclass(frozen=True)
class PolicyFlags:
    """The flag group of every policy that has a config dataclass."""

    groups: Mapping[str, DataclassFlags[Any]]
    """Policy name -> the flags of its config."""

    def options(self, args: argparse.Namespace, chosen: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Policy name -> the options given for it, each checked by its config (a ``ValueError`` naming the
        flag); options of a policy not in ``chosen`` are a ``ValueError`` too."""
        out: dict[str, dict[str, Any]] = {}
        for name, flags in self.groups.items():
            given = flags.given(args)
            if not given:
                continue
            if name not in chosen:
                what = (f"the policy is {chosen[0]!r}" if len(chosen) == 1
                        else f"the policies are {', '.join(map(repr, chosen))}")
                raise ValueError(f"{', '.join(flags.flags[f] for f in given)}: option(s) of policy {name!r}, but "
                                 f"{what} (--policy {name} to use them)")
            flags.apply(args)
            out[name] = given
        return out


def add_policy_flags(parser: argparse.ArgumentParser, names: Sequence[str] | None = None) -> PolicyFlags:
    """Add ``--<policy>-<field>`` for every field of the config of every policy in ``names`` (default: all), a group
    per policy."""
    return PolicyFlags({name: add_dataclass_flags(parser, config_type(), title=f"{name} policy (with --policy {name})",
                                                  prefix=name)
                        for name in (policy_names() if names is None else names)
                        if (config_type := policy_config_type(name)) is not None})
