"""Names in a checkpoint: wrapper prefixes stripped in one place, and load-time remapping rules."""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dist_optim._torch_internals import WRAPPER_COMPONENTS

__all__ = ["canonical_name", "Remap"]

# Path components that wrappers insert into module names. ``module`` (DDP, AveragedModel) only counts at the front.
_WRAPPER_COMPONENTS = WRAPPER_COMPONENTS
_PLACEHOLDER = re.compile(r"^\{([A-Za-z_][A-Za-z0-9_]*)\}$")


def canonical_name(name: str) -> str:
    """The name a checkpoint stores for ``name``: wrapper components removed.

    ``torch.compile`` (``_orig_mod``), activation checkpointing (``_checkpoint_wrapped_module``) and FSDP1
    (``_fsdp_wrapped_module``) insert a component anywhere in the path; DDP and ``AveragedModel`` put ``module`` in
    front. The same parameter therefore has the same name whatever wrapped it when it was saved or loaded.

    >>> canonical_name("module._orig_mod.layers.0._checkpoint_wrapped_module.attn.weight")
    'layers.0.attn.weight'
    """
    parts = [p for p in name.split(".") if p not in _WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def canonical_names(named: Iterable[tuple[str, Any]], what: str) -> dict[str, Any]:
    """``{canonical name: value}``, refusing two names that become one."""
    out: dict[str, Any] = {}
    original: dict[str, str] = {}
    for name, value in named:
        key = canonical_name(name)
        if key in out:
            raise ValueError(
                f"{what}: {original[key]!r} and {name!r} have the same checkpoint name {key!r} once wrapper prefixes "
                "are removed; rename one of the submodules"
            )
        out[key], original[key] = value, name
    return out


def _split_rule(pattern: str) -> list[str | tuple[str]]:
    """``"layers.{i}.attn"`` -> ``["layers", ("i",), "attn"]`` (a tuple is a placeholder)."""
    if not pattern or pattern.startswith(".") or pattern.endswith(".") or ".." in pattern:
        raise ValueError(f"remap pattern {pattern!r} is not a dotted name such as 'layers.{{i}}.attn'")
    out: list[str | tuple[str]] = []
    for part in pattern.split("."):
        m = _PLACEHOLDER.match(part)
        if m:
            out.append((m.group(1),))
        elif "{" in part or "}" in part:
            raise ValueError(f"remap pattern {pattern!r}: a placeholder must be a whole component, like '{{i}}'")
        else:
            out.append(part)
    return out


class Remap:
    """Load-time name mapping from a checkpoint's names (sources) to the current model's names (targets).

    Args:
        rules: ``{source pattern: target pattern}`` or ``{source pattern: [target patterns]}``. A pattern is a
            dotted prefix whose components may be placeholders (``{i}``, one component each); it matches a name's
            leading components and the rest of the name is carried over. ``{"layers.{i}.attn":
            "blocks.{i}.attention"}`` renames ``layers.3.attn.q.weight`` to ``blocks.3.attention.q.weight``. A
            placeholder that only the target has duplicates one source into many targets: ``{"mlp":
            "experts.{e}.mlp"}`` loads ``mlp.*`` into every expert. Rules are tried in order; the first that
            matches a target wins. A callable ``target -> source`` may be passed instead.
        fresh: glob patterns (``fnmatch``) of target names that may be absent from the checkpoint: they keep their
            current values and their optimizer state starts empty, as for a new parameter.
        ignore: glob patterns of checkpoint names that may go unused (dropped parameters).

    The same object serves :func:`dist_optim.checkpoint.load` and in-memory state dicts: :meth:`module_hook` for
    ``module.register_load_state_dict_pre_hook`` and :meth:`optimizer_hook` for
    ``optimizer.register_load_state_dict_pre_hook``.

    >>> r = Remap({"layers.{i}.attn": "blocks.{i}.attention", "mlp": "experts.{e}.mlp"})
    >>> r.source_for("blocks.3.attention.q.weight"), r.source_for("experts.7.mlp.fc.bias"), r.source_for("head.weight")
    ('layers.3.attn.q.weight', 'mlp.fc.bias', 'head.weight')
    """

    def __init__(
        self,
        rules: Mapping[str, str | Sequence[str]] | Callable[[str], str] | None = None,
        *,
        fresh: Sequence[str] = (),
        ignore: Sequence[str] = (),
    ) -> None:
        self._fn: Callable[[str], str] | None = None
        self._rules: list[tuple[list[str | tuple[str]], list[str | tuple[str]]]] = []
        if callable(rules):
            self._fn = rules
        elif rules is not None:
            for source, targets in rules.items():
                src = _split_rule(source)
                for target in [targets] if isinstance(targets, str) else list(targets):
                    dst = _split_rule(target)
                    unbound = {p[0] for p in src if isinstance(p, tuple)} - {p[0] for p in dst if isinstance(p, tuple)}
                    if unbound:
                        raise ValueError(
                            f"remap rule {source!r} -> {target!r}: placeholder(s) {sorted(unbound)} appear only in the "
                            "source, so the source name cannot be built from a target name"
                        )
                    self._rules.append((src, dst))
        for what, patterns in (("fresh", fresh), ("ignore", ignore)):
            if isinstance(patterns, str):
                raise TypeError(f"{what}= takes a list of patterns, got the string {patterns!r}; write [{patterns!r}]")
        self.fresh = tuple(fresh)
        self.ignore = tuple(ignore)

    def source_for(self, target: str) -> str:
        """The checkpoint name that ``target`` loads from."""
        if self._fn is not None:
            return self._fn(target)
        parts = target.split(".")
        for src, dst in self._rules:
            if len(parts) < len(dst):
                continue
            bound: dict[str, str] = {}
            for want, got in zip(dst, parts):
                if isinstance(want, tuple):
                    if bound.setdefault(want[0], got) != got:
                        break
                elif want != got:
                    break
            else:
                head = [bound[p[0]] if isinstance(p, tuple) else p for p in src]
                return ".".join(head + parts[len(dst):])
        return target

    def is_fresh(self, target: str) -> bool:
        return any(fnmatch.fnmatchcase(target, p) for p in self.fresh)

    def is_ignored(self, source: str) -> bool:
        return any(fnmatch.fnmatchcase(source, p) for p in self.ignore)

    def plan(self, targets: Iterable[str], sources: Iterable[str]) -> tuple[dict[str, str], list[str], list[str]]:
        """``({target: source}, missing targets, unexpected sources)``, the fresh/ignored ones left out."""
        sources = set(sources)
        mapping: dict[str, str] = {}
        missing: list[str] = []
        for t in targets:
            s = self.source_for(t)
            if s in sources:
                mapping[t] = s
            elif not self.is_fresh(t):
                missing.append(t)
        used = set(mapping.values())
        unexpected = sorted(s for s in sources if s not in used and not self.is_ignored(s))
        return mapping, missing, unexpected

    # -- in-memory state dicts ----------------------------------------------------------------------------------
    def module_hook(self, module: Any, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """For ``module.register_load_state_dict_pre_hook``: rewrites ``state_dict`` to the module's names, in
        place (sources used by a target are replaced by it; the rest is left for ``strict`` to report)."""
        own = {k: canonical_name(k) for k in module.state_dict()}  # the module's keys -> their checkpoint names
        found = {canonical_name(k[len(prefix):]): k for k in state_dict if k.startswith(prefix)}
        mapping, _, _ = self.plan(own.values(), found)
        loaded = {prefix + k: state_dict[found[mapping[name]]] for k, name in own.items() if name in mapping}
        for source in {found[s] for s in mapping.values()}:
            del state_dict[source]
        state_dict.update(loaded)

    def optimizer_hook(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        """For ``optimizer.register_load_state_dict_pre_hook``: reorders a state dict saved with ``param_names``
        (``InBackwardOptimizer`` always writes them; torch optimizers do when built from ``named_parameters()``)
        so that each of ``optimizer``'s parameters gets the state of its source name."""
        saved_names = [n for g in state_dict["param_groups"] for n in _group_names(g, "the state dict")]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_name = dict(zip((canonical_name(n) for n in saved_names), saved_ids))
        state: dict[int, Any] = {}
        groups = []
        index = 0
        for gi, group in enumerate(optimizer.param_groups):
            names = [canonical_name(n) for n in _group_names(group, "the optimizer")]
            saved_group = state_dict["param_groups"][min(gi, len(state_dict["param_groups"]) - 1)]
            ids = []
            for name in names:
                src = by_name.get(self.source_for(name))
                if src is None and not self.is_fresh(name):
                    raise KeyError(
                        f"optimizer parameter {name!r} (source {self.source_for(name)!r}) is not in the state dict; "
                        f"closest: {closest(self.source_for(name), by_name)}. List it in fresh= to start it empty"
                    )
                if src is not None and src in state_dict["state"]:
                    state[index] = state_dict["state"][src]
                ids.append(index)
                index += 1
            groups.append({**saved_group, "params": ids, "param_names": list(_group_names(group, "the optimizer"))})
        return {"state": state, "param_groups": groups}


def _group_names(group: Mapping[str, Any], what: str) -> list[str]:
    names = group.get("param_names")
    if names is None:
        raise ValueError(
            f"{what} has no 'param_names': name-based remapping needs them (build the optimizer from "
            "model.named_parameters(), or use InBackwardOptimizer, which always records them)"
        )
    return list(names)


def closest(name: str, candidates: Iterable[str], n: int = 2) -> str:
    found = difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)
    return ", ".join(repr(c) for c in found) if found else "none"


def mismatch_message(where: str, missing: Sequence[str], unexpected: Sequence[str], limit: int = 20) -> str:
    """One message listing missing *and* unexpected names, each with its closest candidates."""
    lines = [f"checkpoint {where} does not match what is being loaded:"]
    if missing:
        lines.append(f"  {len(missing)} missing (in the model, not in the checkpoint):")
        lines += [f"    {m}  (closest in checkpoint: {closest(m, unexpected)})" for m in missing[:limit]]
        if len(missing) > limit:
            lines.append(f"    ... and {len(missing) - limit} more")
    if unexpected:
        lines.append(f"  {len(unexpected)} unexpected (in the checkpoint, not used):")
        lines += [f"    {u}  (closest in model: {closest(u, missing)})" for u in unexpected[:limit]]
        if len(unexpected) > limit:
            lines.append(f"    ... and {len(unexpected) - limit} more")
    lines.append(
        "Map renamed names with remap=Remap({'old.prefix': 'new.prefix'}), let new names start fresh with "
        "Remap(fresh=[...]), drop old ones with Remap(ignore=[...]), or pass strict=False"
    )
    return "\n".join(lines)
