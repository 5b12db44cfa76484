"""Building the run configuration from plain data: YAML read within bounds, dotted overrides, `null` as unset, every
value type-checked against its field (a `Literal` choice, a typed container, a finite float) and renamed keys refused
naming their new name. Each error is a ConfigError naming the dotted key. config.py builds `Config` with these."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

import yaml

from .config_sections import ConfigError, _require

def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------------------------------------------
# building dataclasses from plain dicts, with type checks
# --------------------------------------------------------------------------------------------------------------

_NONE = type(None)


def _fail(key: str, value: Any, expected: str) -> typing.NoReturn:
    raise ConfigError(f"config key '{key}' must be {expected}, got {type(value).__name__} ({value!r})")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _items(key: str, value: Any, n: int | None = None) -> list:
    """A YAML list (or a tuple) of n items (any number when n is None)."""
    if not isinstance(value, (list, tuple)):
        _fail(key, value, "a list" if n is None else f"a list of {n} items")
    if n is not None and len(value) != n:
        raise ConfigError(f"config key '{key}' must be a list of {n} items, got {len(value)} ({list(value)!r})")
    return list(value)


def _check_union(key: str, value: Any, args: tuple) -> Any:
    if value is None and _NONE in args:
        return None
    inner = [a for a in args if a is not _NONE]
    errors = []
    for tp in inner:
        try:
            return _check_type(key, value, tp)
        except ConfigError as err:
            errors.append(err)
    if len(errors) == 1:
        raise errors[0]
    _fail(key, value, " or ".join(_type_name(tp) for tp in inner))


def _check_container(key: str, value: Any, base: type, args: tuple) -> Any:
    if base is tuple:
        if args and args[-1] is Ellipsis:  # tuple[X, ...]
            return tuple(_check_type(f"{key}[{i}]", v, args[0]) for i, v in enumerate(_items(key, value)))
        values = _items(key, value, len(args) if args else None)
        types_ = args or (Any,) * len(values)
        return tuple(_check_type(f"{key}[{i}]", v, tp) for i, (v, tp) in enumerate(zip(values, types_)))
    if base is list:
        return [_check_type(f"{key}[{i}]", v, args[0] if args else Any) for i, v in enumerate(_items(key, value))]
    if not isinstance(value, dict):
        _fail(key, value, "a mapping")
    key_tp, value_tp = args or (Any, Any)
    for k in value:
        _require(key_tp is Any or isinstance(k, key_tp), key, f"must have {_type_name(key_tp)} keys, got {k!r}")
    return {k: _check_type(f"{key}.{k}", v, value_tp) for k, v in value.items()}


def _check_scalar(key: str, value: Any, tp: type) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                value, number = float(value), True
            except ValueError:
                pass
        if number:
            _require(math.isfinite(value), key, f"must be a finite number, got {value}")
            return float(value)
    elif tp is int:
        if number and isinstance(value, int):
            return value
    elif isinstance(value, tp):
        return value
    _fail(key, value, f"of type {tp.__name__}")


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """`value` as type `tp` (YAML lists become tuples where typed so), or a ConfigError naming `key`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value or {}, f"{key}.")
    if origin is Literal:
        if any(value == choice and type(value) is type(choice) for choice in args):
            return value
        raise ConfigError(f"config key '{key}' must be one of {', '.join(map(str, args))}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        return _check_union(key, value, args)
    if (origin or tp) in (tuple, list, dict):
        return _check_container(key, value, origin or tp, args)
    if tp in (float, int, bool, str):
        return _check_scalar(key, value, tp)
    return value


# keys that were renamed: their old name gets an error naming the new one
# (one meaning per name: each line names the old key and the new one together, which
# a rename script leaves as it is)
RENAMED = {
    "parallel.backend": "parallel.engine",
    "model.gradient_checkpointing": "parallel.activation_checkpointing",
    "grpo.beta": "grpo.kl_beta",  # GRPO's KL weight (beside nft.kl_beta)
    "nft.beta": "nft.mix",  # the implicit policies' mixing weight, not a KL weight
    "model.shard_t5": "model.shard_text_encoder",  # shards Qwen2.5-VL, Mistral and UMT5 encoders too
    "train.batch_size": "train.minibatch_size",  # samples per optimizer step, over all ranks
    "sampling.batch_size": "sampling.chunk_size",  # rollout rows per forward on one rank
    "eval.batch_size": "eval.chunk_size",  # evaluation images per forward on one rank
    "jagg.plan": "jagg.planner",  # picks the planner (uniform | budget); a plan is what a planner makes
    # GRPO's sampler keys, in its own section (DiffusionNFT's rollout has no SDE window)
    "sampling.sde_window": "grpo.sde_window",
    "sampling.sde_window_range": "grpo.sde_window_range",
    "sampling.sde_window_mode": "grpo.sde_window_mode",
    "sampling.sde_window_every": "grpo.sde_window_every",
}


def _unset_by_null(tp: Any, default: Any) -> bool:
    """Whether null given for a field of type `tp` means "unset" (its default): everywhere but a key whose null is a
    value of its own beside another default (sampling.shift: null = the pipeline's schedule, default 3.0)."""
    return not (_NONE in typing.get_args(tp) and default is not None)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if f"{prefix}{key}" in RENAMED:
            raise ConfigError(f"config key '{prefix}{key}' is now '{RENAMED[prefix + key]}' (same values): rename it")
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}' (valid keys: {', '.join(sorted(names))})")
    given = {f.name for f in dataclasses.fields(cls) if f.name in data
             and not (data[f.name] is None and (dataclasses.is_dataclass(hints[f.name])
                                                or _unset_by_null(hints[f.name], _default(f))))}
    return cls(**{name: _check_type(f"{prefix}{name}", data[name], hints[name]) for name in given})


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        if node.get(part, {}) is None:  # 'jagg=null jagg.mode=exact': the section reset, then one key set in it
            node[part] = {}
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set '{dotted}': '{part}' is not a section")
    node[parts[-1]] = value


# A config is a few hundred values; these bounds stop a hostile file (an anchor bomb: a few lines whose aliases
# expand to billions of values once any code walks them; a deeply nested one) before anything walks it.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000  # scalars and containers, every alias counted as often as it is used
MAX_YAML_DEPTH = 32


def _yaml(text: str, where: str) -> Any:
    """yaml.safe_load within the bounds above, with a YAML syntax error (or a bound passed) as a ConfigError naming
    `where` (and the line and column)."""
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{where} is {len(text)} characters; a config is read up to {MAX_YAML_BYTES}")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()  # the node graph: aliases are references here, nothing expanded yet
        if node is None:
            return None
        values, depth = _expanded(node, {})
        if values > MAX_YAML_VALUES or depth > MAX_YAML_DEPTH:
            raise ConfigError(f"{where} expands to {values} values nested {depth} deep (aliases counted each time "
                              f"they are used); a config may hold {MAX_YAML_VALUES} nested {MAX_YAML_DEPTH} deep")
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{where} is not valid YAML{at}: {problem}") from None
    except RecursionError:  # the composer recurses once per level
        raise ConfigError(f"{where} is nested too deeply (a config may nest {MAX_YAML_DEPTH} deep)") from None
    finally:
        loader.dispose()


def _expanded(node, memo: dict) -> tuple[int, int]:
    """(values, depth) of `node` with every alias expanded, computed once per node (an alias is the same node
    object): the cost of walking the constructed data, without constructing it."""
    key = id(node)
    if key not in memo:
        memo[key] = (1, 1)  # a recursive alias (a node inside itself) counts once, then the bound catches its use
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        values, depth = 1, 0
        for child in children:
            v, d = _expanded(child, memo)
            values, depth = min(values + v, 1 << 62), max(depth, d)
        memo[key] = (values, depth + 1)
    return memo[key]


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip(), _yaml(raw, f"the value of override {text!r}") if raw.strip() else None
