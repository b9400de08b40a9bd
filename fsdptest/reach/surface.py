"""FSDP1's public surface as rows of the reach table (see [Note: How reach is
measured] in fsdptest.reach): read from the implementations by introspection,
with the values that matter for each argument and field."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
from pathlib import Path
from typing import Any, NamedTuple

BOOLS = ("False", "True")
# FSDP2's names, which both modules export beside FSDP1's: not this table's surface.
FSDP2_NAMES = frozenset(
    {
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
        "FSDPModule",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "UnshardHandle",
    }
)
DTYPES = ("None", "float16", "bfloat16")

# The values of each constructor argument that change what FSDP does.
CONSTRUCTOR_VALUES: dict[str, tuple[str, ...]] = {
    "module": ("an nn.Module",),
    "process_group": ("None", "a ProcessGroup", "(shard group, replicate group)"),
    "cpu_offload": ("None", "CPUOffload(offload_params=False)", "CPUOffload(offload_params=True)"),
    "auto_wrap_policy": (
        "None",
        "ModuleWrapPolicy",
        "size_based_auto_wrap_policy",
        "transformer_auto_wrap_policy",
        "lambda_auto_wrap_policy",
        "CustomPolicy",
        "_or_policy",
    ),
    "backward_prefetch": ("None", "BACKWARD_PRE", "BACKWARD_POST"),
    "mixed_precision": ("None", "MixedPrecision"),
    "ignored_modules": ("None", "modules"),
    "param_init_fn": ("None", "a callable"),
    "device_id": ("None", "torch.device", "int"),
    "ignored_states": ("None", "parameters", "modules"),
    "device_mesh": ("None", "1-D", "2-D"),
}
ENUM_ARGUMENTS = {"sharding_strategy": "ShardingStrategy"}

# The values of config fields that are neither booleans nor dtypes.
FIELD_VALUES: dict[str, tuple[str, ...]] = {
    "_module_classes_to_ignore": ("(_BatchNorm,)", "(_BatchNorm, LayerNorm)"),
    "state_dict_type": ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"),
    "state_dict_config": ("read",),
    "optim_state_dict_config": ("read",),
}
DTYPE_FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")
# The values of method arguments that are neither booleans nor passed objects.
METHOD_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    ("clip_grad_norm_", "norm_type"): ("1.0", "2.0", "inf"),
}

MODEL_SHAPES = (
    "autograd off in forward: torch.no_grad()",
    "autograd off in forward: .detach()",
    "autograd off in forward: torch.inference_mode()",
    "autograd off in forward: requires_grad=False",
    "a forward under torch.no_grad()",
    "frozen subtree (a whole unit)",
    "frozen parameters beside trainable ones in one unit",
    "parameters no unit manages (ignored)",
    "shared parameters (a module used twice)",
    "tied parameters (one parameter, two modules)",
    "buffers: float32",
    "buffers: float64",
    "buffers: float16",
    "buffers: bfloat16",
    "buffers: int64",
    "buffers: non-persistent",
    "parameters replaced by the user (a new nn.Parameter)",
    "parameter data replaced by the user (p.data = ...)",
    "ranks that hold only padding, world size 3",
    "ranks that hold only padding, world size 4",
    "several forwards before one backward",
    "activation checkpointing",
    "integer inputs (an embedding)",
)


class Row(NamedTuple):
    section: str  # constructor, config, enum, environment, method, attribute, model
    key: str


def _modules() -> dict[str, Any]:
    return {
        "fsdp": importlib.import_module("fsdp"),
        "torch": importlib.import_module("torch.distributed.fsdp"),
    }


def constructor_rows() -> list[Row]:
    """``FSDP(arg=value)`` for every argument of either implementation."""
    rows: list[Row] = []
    for name in _constructor_arguments():
        for value in _argument_values(name):
            rows.append(Row("constructor", f"FSDP({name}={value})"))
    return rows


def _constructor_arguments() -> list[str]:
    names: list[str] = []
    for module in _modules().values():
        signature = inspect.signature(module.FullyShardedDataParallel.__init__)
        for name in list(signature.parameters)[1:]:
            if name not in names:
                names.append(name)
    return names


def _argument_values(name: str) -> tuple[str, ...]:
    if name in CONSTRUCTOR_VALUES:
        return CONSTRUCTOR_VALUES[name]
    if name in ENUM_ARGUMENTS:
        return tuple(m.name for m in _enum(ENUM_ARGUMENTS[name]))
    default = _default_of(name)
    if isinstance(default, bool):
        return BOOLS
    raise LookupError(f"the reach table does not know FSDP's argument {name!r}")


def _default_of(name: str) -> Any:
    for module in _modules().values():
        parameter = inspect.signature(module.FullyShardedDataParallel.__init__).parameters.get(name)
        if parameter is not None:
            return parameter.default
    return None


def _enum(name: str) -> list[enum.Enum]:
    members: list[enum.Enum] = []
    for module in _modules().values():
        for member in getattr(module, name):
            if member.name not in {m.name for m in members}:
                members.append(member)
    return members


def config_rows() -> list[Row]:
    """``Class.field=value`` for every field of every config dataclass of either."""
    rows: list[Row] = []
    for cls_name, fields in _config_classes().items():
        for field in fields:
            for value in _field_values(cls_name, field):
                rows.append(Row("config", f"{cls_name}.{field}={value}"))
    return rows


def _config_classes() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for module in _modules().values():
        for name in sorted(dir(module)):
            value = getattr(module, name)
            if name.startswith("_") or name in FSDP2_NAMES or not dataclasses.is_dataclass(value):
                continue
            fields = found.setdefault(name, [])
            for field in dataclasses.fields(value):
                if field.name not in fields:
                    fields.append(field.name)
    return found


def _field_values(cls_name: str, field: str) -> tuple[str, ...]:
    if field in DTYPE_FIELDS:
        return DTYPES
    if field in FIELD_VALUES:
        return FIELD_VALUES[field]
    for module in _modules().values():
        cls = getattr(module, cls_name, None)
        if cls is not None and field in {f.name for f in dataclasses.fields(cls)}:
            default = next(f.default for f in dataclasses.fields(cls) if f.name == field)
            if isinstance(default, bool):
                return BOOLS
    raise LookupError(f"the reach table does not know {cls_name}.{field}")


def enum_rows() -> list[Row]:
    rows: list[Row] = []
    for name in _enum_classes():
        rows.extend(Row("enum", f"{name}.{m.name}") for m in _enum(name))
    return rows


def _enum_classes() -> list[str]:
    names: list[str] = []
    for module in _modules().values():
        for name in sorted(dir(module)):
            value = getattr(module, name)
            public = not name.startswith("_") and name not in FSDP2_NAMES
            if public and isinstance(value, type) and issubclass(value, enum.Enum):
                if name not in names:
                    names.append(name)
    return names


def environment_rows() -> list[Row]:
    return [Row("environment", f"env {name}") for name in torch_environment_variables()]


def torch_environment_variables() -> list[str]:
    """The environment variables torch's FSDP reads: its ``_FSDP_* = "..."``
    constants, and ``TORCH_DISTRIBUTED_DEBUG`` where it reads the debug level."""
    root = Path(importlib.import_module("torch.distributed.fsdp").__file__).parent
    names: list[str] = []
    debug = False
    for path in sorted(root.glob("*.py")):
        text = path.read_text()
        names.extend(re.findall(r'^_FSDP_\w+ = "(\w+)"', text, flags=re.MULTILINE))
        debug = debug or "get_debug_level()" in text
    if debug:
        names.append("TORCH_DISTRIBUTED_DEBUG")
    return sorted(set(names))


def method_rows() -> list[Row]:
    """``method()`` for every public method of either implementation's class, and
    ``method(arg)`` (``method(arg=value)`` for a boolean) for each argument."""
    rows: list[Row] = []
    for name, signature in public_methods().items():
        rows.append(Row("method", f"{name}()"))
        for arg in _arguments(signature):
            values = METHOD_VALUES.get((name, arg.name))
            if isinstance(arg.default, bool):
                values = BOOLS
            rows.append(Row("method", f"{name}({arg.name})"))
            rows.extend(Row("method", f"{name}({arg.name}={v})") for v in values or ())
    return rows


def public_methods() -> dict[str, inspect.Signature]:
    found: dict[str, inspect.Signature] = {}
    for module in _modules().values():
        cls = module.FullyShardedDataParallel
        for name, value in vars(cls).items():
            if name.startswith("_") or isinstance(value, property):
                continue
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if callable(function) and name not in found:
                found[name] = inspect.signature(function)
    return found


def _arguments(signature: inspect.Signature) -> list[inspect.Parameter]:
    plain = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p for p in signature.parameters.values() if p.name != "self" and p.kind not in plain]


def attribute_rows() -> list[Row]:
    """Public attributes either class defines (properties): what a unit says of itself."""
    names: set[str] = set()
    for module in _modules().values():
        for name, value in vars(module.FullyShardedDataParallel).items():
            if not name.startswith("_") and isinstance(value, property):
                names.add(name)
    return [Row("attribute", f"attribute {name}") for name in sorted(names)]


def model_rows() -> list[Row]:
    return [Row("model", f"model: {shape}") for shape in MODEL_SHAPES]


def all_rows() -> list[Row]:
    return [
        *constructor_rows(),
        *config_rows(),
        *enum_rows(),
        *environment_rows(),
        *method_rows(),
        *attribute_rows(),
        *model_rows(),
    ]
