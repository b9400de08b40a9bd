"""The FSDP2 API under test (``fully_shard`` and its companions) and the seams its
tests patch, for whichever implementation ``--fsdp-impl`` names.

[Note: Which implementations provide FSDP2]
An implementation provides the FSDP1 API (``FullyShardedDataParallel``, ...), FSDP2,
or both. It provides FSDP2 when its module has ``fully_shard`` *and*
``FSDPModule``: a ``fully_shard`` alone may be FSDP1's composable form, as this
project's ``fsdp.fully_shard`` is until its FSDP2 exists. ``fsdptest.api`` then
gives the module's ``FSDP2_NAMES`` (a companion the module lacks, say
``UnshardHandle``, is a stand-in that skips the test using it, naming it). An
implementation without FSDP2 gets a stand-in for every name: using one skips the
test (``UnavailablePart``, a ``unittest.SkipTest``) with ``Fsdp2API.missing``,
which names what the module lacks. The plugin skips such tests before any rank
starts (a test marked ``fsdp2``, or whose module imported a stand-in), and a
session in which no test passed but some were skipped for this reason fails
(``fsdptest.plugin``): a skip is never a pass, and a run of FSDP2 tests against an
implementation without FSDP2 is never green.

[Note: FSDP2 seams]
Upstream's FSDP2 tests patch an implementation at seven places (``patch_all_gather``,
``patch_reduce_scatter``, ``patch_all_reduce``, ``patch_unshard``, ``patch_reshard``,
``patch_post_backward``, ``patch_register_post_backward_hook_backward`` in
``upstream.common_fsdp``). An implementation declares where each is as a mapping
from the seam's name (``SEAM_NAMES``) to a dotted path:

- ``all_gather``, ``reduce_scatter``, ``all_reduce``: the collective function it
  calls (looked up there at call time). Upstream's replacements forward what they
  get to torch's function (``all_gather_single(output, input, group=...)``,
  ``reduce_scatter_single(output, input, op=..., group=...)``,
  ``all_reduce(tensor, op=..., group=...)``), so the patch hands them the call in
  that form: the tensors positional (output and input; all-reduce's one tensor),
  every other argument as a keyword named as the function names it. The function
  names them as torch does (``group``, ``op``).
- ``unshard``, ``reshard``, ``post_backward``: methods of its parameter-group class
  (one group per ``fully_shard`` call), called as ``(self, *args)``.
- ``register_post_backward_hook_backward``: the ``backward`` of the autograd
  function whose backward runs the groups' post-backward, called as
  ``(ctx, *grads)``.

Torch's mapping is written here (``torch_seams``): the single-tensor collectives
its FSDP2 calls (``all_gather_single``/``reduce_scatter_single`` on torch 2.13,
``all_gather_into_tensor``/``reduce_scatter_tensor`` on 2.11; ``all_reduce``),
``FSDPParamGroup.unshard``/``reshard``/``post_backward`` and
``RegisterPostBackwardFunction.backward``. Every other implementation declares its
own as ``<module>._fully_shard.SEAMS: dict[str, str]`` (this project's:
``fsdp._fully_shard.SEAMS``); a missing mapping, or a seam missing from it, skips
the test that patches it, naming what is missing. A path that names a
single-tensor collective of ``torch.distributed`` stands for every name torch has
for it (torch 2.13 keeps the old names beside the new): all are patched, and a call
that passes through two of them reaches the replacement once. A patch replaces the
attribute at the path for the ``with`` block and puts back exactly what was there
(a ``staticmethod`` stays one; an inherited method is deleted again).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any

import torch.distributed as dist

from fsdptest.adapters import UnavailablePart, unavailable
from fsdptest.implementations import Implementation

FSDP2_NAMES: tuple[str, ...] = (
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "register_fsdp_forward_method",
    "UnshardHandle",
)
"""The public FSDP2 names ``fsdptest.api`` gives (torch's ``torch.distributed.fsdp`` has them)."""

FSDP2_DEFINING: tuple[str, ...] = ("fully_shard", "FSDPModule")
"""What makes an implementation one that provides FSDP2 (see the module note)."""

SEAM_NAMES: tuple[str, ...] = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "unshard",
    "reshard",
    "post_backward",
    "register_post_backward_hook_backward",
)

_DIST_ALIASES: tuple[tuple[str, ...], ...] = (
    ("all_gather_single", "all_gather_into_tensor"),
    ("reduce_scatter_single", "reduce_scatter_tensor"),
)
_TORCH_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


@dataclass(frozen=True)
class Fsdp2KnownDefects:
    """Wrong results of torch's FSDP2 found by the FSDP2 suites; each field names
    where it is handled. Other implementations have none: the suites hold them to
    the specification."""

    inf_norm_with_an_empty_shard: bool = False
    """``clip_grad_norm_(norm_type=inf)`` over DTensor gradients raises on a rank whose
    shard of some gradient is empty (``torch.chunk`` leaves the last ranks nothing: 4
    rows over 3 ranks are 2, 2, 0; ``linalg.vector_norm`` has no identity for the inf
    norm of an empty tensor) while the other ranks wait in the norm's reduction.
    Not assertable without a hang: suites/fsdp2 skips those configurations."""
    marks_module_before_validating: bool = False
    """A ``fully_shard`` that refused its arguments leaves the module marked as
    applied, so a corrected second call is refused
    (suites/fsdp2/test_fsdp2_errors.py asserts it)."""
    dataclass_outputs_not_unsharded_in_backward: bool = False
    """Before torch 2.13: a group's outputs inside a dataclass get no pre-backward
    hook, so a group resharded after forward is not all-gathered again and its
    backward fails ("setStorage: ... out of bounds for storage of size 0").
    suites/fsdp2 skips those configurations (``skip_dataclass_outputs``)."""

    @classmethod
    def of_torch(cls) -> Fsdp2KnownDefects:
        """Torch's, for the torch that runs: every defect, less those its version fixed."""
        present = {f.name: True for f in fields(cls)}
        present["dataclass_outputs_not_unsharded_in_backward"] = _torch_before(2, 13)
        return cls(**present)


def _torch_before(major: int, minor: int) -> bool:
    import torch

    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    return version < (major, minor)


class Fsdp2API:
    """The FSDP2 names one implementation's module has (see the module note)."""

    implementation: Implementation
    module_name: str
    provided: bool
    """Whether the implementation provides FSDP2 at all."""
    absent: tuple[str, ...]
    """The names of ``FSDP2_DEFINING`` its module lacks."""
    found: dict[str, Any]
    stand_ins: dict[str, Any]
    known_defects: Fsdp2KnownDefects

    def __init__(self, implementation: Implementation, module: ModuleType) -> None:
        self.implementation = implementation
        is_torch = implementation.kind == "torch"
        self.known_defects = Fsdp2KnownDefects.of_torch() if is_torch else Fsdp2KnownDefects()
        self.module_name = module.__name__
        self.absent = tuple(name for name in FSDP2_DEFINING if not _has(module, name))
        self.provided = not self.absent
        present = (name for name in FSDP2_NAMES if _has(module, name))
        self.found = {name: getattr(module, name) for name in present} if self.provided else {}
        self.stand_ins = {
            name: unavailable(name, self._reason(name))
            for name in FSDP2_NAMES
            if name not in self.found
        }

    @property
    def missing(self) -> str:
        """Why an FSDP2 test cannot run against this implementation ("" when it can)."""
        if self.provided:
            return ""
        return (
            f"needs FSDP2 ({' and '.join(FSDP2_DEFINING)}), which the FSDP under test "
            f"({self.implementation.describe()}, {self.implementation.origin}) does not "
            f"provide: {self.module_name} has no {' and no '.join(self.absent)}"
        )

    def names(self) -> dict[str, Any]:
        """Every name of ``FSDP2_NAMES``: the implementation's, or a stand-in that skips."""
        return self.found | self.stand_ins

    def _reason(self, name: str) -> str:
        if not self.provided:
            return self.missing
        return (
            f"needs {name}, which the FSDP under test ({self.implementation.describe()}) "
            f"does not have (looked in {self.module_name})"
        )


def _has(module: ModuleType, name: str) -> bool:
    return hasattr(module, name) and not isinstance(getattr(module, name), ModuleType)


def torch_seams() -> dict[str, str]:
    """Torch's FSDP2 seams on the installed torch (see [Note: FSDP2 seams])."""
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter = (
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor"
    )
    return {
        "all_gather": f"torch.distributed.{gather}",
        "reduce_scatter": f"torch.distributed.{scatter}",
        "all_reduce": "torch.distributed.all_reduce",
        "unshard": f"{_TORCH_GROUP}.FSDPParamGroup.unshard",
        "reshard": f"{_TORCH_GROUP}.FSDPParamGroup.reshard",
        "post_backward": f"{_TORCH_GROUP}.FSDPParamGroup.post_backward",
        "register_post_backward_hook_backward": (
            f"{_TORCH_GROUP}.RegisterPostBackwardFunction.backward"
        ),
    }


class Fsdp2Seams:
    """Where the implementation under test has each FSDP2 seam (see [Note: FSDP2
    seams]); the declaration is read on first use."""

    implementation: Implementation
    _declared: dict[str, str] | None

    def __init__(self, implementation: Implementation) -> None:
        self.implementation = implementation
        self._declared = None

    @property
    def declaration(self) -> str:
        """Where the mapping comes from."""
        if self.implementation.kind == "torch":
            return "torch's, written in fsdptest.fsdp2"
        return f"{self.implementation.module}._fully_shard.SEAMS"

    def path(self, name: str) -> str:
        """The dotted path of seam ``name``; skips the test when it is not declared."""
        if name not in SEAM_NAMES:
            raise ValueError(f"{name!r} is not an FSDP2 seam; the seams are {SEAM_NAMES}")
        declared = self.declared()
        if name not in declared:
            raise UnavailablePart(
                f"needs the FSDP2 seam {name!r}, which the FSDP under test "
                f"({self.implementation.describe()}) does not declare in {self.declaration}"
            )
        return declared[name]

    def declared(self) -> dict[str, str]:
        if self._declared is None:
            self._declared = self._read()
        return self._declared

    def _read(self) -> dict[str, str]:
        if self.implementation.kind == "torch":
            return torch_seams()
        try:
            module = importlib.import_module(f"{self.implementation.module}._fully_shard")
        except ModuleNotFoundError as error:
            if not f"{self.implementation.module}._fully_shard".startswith(error.name or "?"):
                raise
            return {}
        seams = getattr(module, "SEAMS", {})
        if not isinstance(seams, Mapping):
            raise TypeError(f"{self.declaration} must map seam names to dotted paths")
        unknown = sorted(set(seams) - set(SEAM_NAMES))
        if unknown:
            raise ValueError(f"{self.declaration} names unknown seams {unknown}: {SEAM_NAMES}")
        return dict(seams)

    def original(self, name: str) -> Callable[..., Any]:
        """What seam ``name`` calls today (for a replacement that calls it on)."""
        owner, attr = _targets(self.path(name))[0]
        found: Callable[..., Any] = getattr(owner, attr)
        return found

    @contextlib.contextmanager
    def patch(self, name: str, new: Callable[..., Any]) -> Iterator[None]:
        """Replaces seam ``name`` by ``new`` for the ``with`` block."""
        path = self.path(name)
        targets = _targets(path)
        saved = [(owner, attr, _raw(owner, attr)) for owner, attr in targets]
        guard = threading.local()
        for owner, attr, _ in saved:
            original = getattr(owner, attr)
            if len(saved) > 1:
                replacement = _guarded(new, original, guard)
            elif name in _TENSORS_FIRST and not path.startswith("torch.distributed."):
                replacement = _as_torch_call(new, original, _TENSORS_FIRST[name])
            else:
                replacement = new
            setattr(owner, attr, replacement)
        try:
            yield
        finally:
            for owner, attr, raw in reversed(saved):
                _put_back(owner, attr, raw)


_ABSENT = object()
_TENSORS_FIRST = {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1}
"""How many leading tensors a collective seam takes positionally (see [Note: FSDP2 seams])."""


def _as_torch_call(
    new: Callable[..., Any], original: Callable[..., Any], tensors: int
) -> Callable[..., Any]:
    """``new`` at an implementation's own collective function: called with the
    leading tensors positional and every other argument as a keyword, as torch's
    function is (see [Note: FSDP2 seams])."""
    signature = inspect.signature(original)

    def patched(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        names = list(arguments)
        leading = [arguments[n] for n in names[:tensors]]
        return new(*leading, **{n: arguments[n] for n in names[tensors:]})

    return patched


def _targets(path: str) -> list[tuple[Any, str]]:
    """(owner, attribute) of every name the seam at ``path`` stands for."""
    module_name, _, attr = path.rpartition(".")
    if module_name == "torch.distributed":
        aliases = next((group for group in _DIST_ALIASES if attr in group), (attr,))
        return [(dist, name) for name in aliases if hasattr(dist, name)]
    return [(_owner(module_name), attr)]


def _owner(dotted: str) -> Any:
    """The module, or the attribute of the longest importable prefix, at ``dotted``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ModuleNotFoundError(f"no module along the seam path {dotted!r}")


def _raw(owner: Any, attr: str) -> Any:
    """What ``owner`` itself holds for ``attr`` (a class's own descriptor, not the
    function it gives), or ``_ABSENT`` for an attribute a class inherits."""
    if isinstance(owner, type):
        return vars(owner).get(attr, _ABSENT)
    return getattr(owner, attr)


def _put_back(owner: Any, attr: str, raw: Any) -> None:
    if raw is _ABSENT:
        delattr(owner, attr)
    else:
        setattr(owner, attr, raw)


def _guarded(
    new: Callable[..., Any], original: Callable[..., Any], guard: threading.local
) -> Callable[..., Any]:
    """``new`` at one of several names of a collective: a call made while another of
    the names is inside the replacement goes to the original (counted once)."""

    def patched(*args: Any, **kwargs: Any) -> Any:
        if getattr(guard, "inside", False):
            return original(*args, **kwargs)
        guard.inside = True
        try:
            return new(*args, **kwargs)
        finally:
            guard.inside = False

    return patched
