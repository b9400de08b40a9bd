"""What the module sees under its original parameter names, and how user changes
to them reach the flat parameter.

[Note: Original parameters (use_orig_params=True)]
Between iterations each original ``nn.Parameter`` is a 1-D view of its part of
the local shard (empty on ranks that hold none of it), so optimizers step on the
shard in place; its ``.grad`` is the matching view of the sharded gradient.
During forward and backward the module sees plain ``Tensor`` views of the
unsharded flat parameter (autograd must reach the flat parameter); in forward
they are also listed in ``_parameters`` so ``named_parameters()`` keeps the
original names. Before every unshard, changes the user made (``.data``
assignment, a new Parameter, a new ``.grad``) are written back into the flat
parameter. Strategies that do not reshard after forward keep forward's views
until backward; changing a parameter in between is an error.

[Note: Cheap between-use bookkeeping]
Every unit re-points its original names after each reshard and checks them
for user changes before each unshard, twice per iteration: with many small
units that dominated a step's CPU time. So the resharded views of the local
shard are built once per shard tensor and re-used (a parameter already viewing
the right memory is not touched), the gradient views likewise per gradient
tensor, and the writeback check first compares each name by identity and data
pointer with what was last shown, which is all that is needed when nothing
changed; only a mismatch takes the full comparison. Showing a view under its
name writes the module's dicts directly where only ``nn.Module``'s own code
would run (see [Note: Writing the module's dicts] in fsdp._setattr).

[Note: Views are made with autograd on]
Forward's ``Tensor`` views must be autograd views of the flat parameter, or the
gradient never reaches it: the unit's ``AccumulateGrad`` node, its
post-backward hook and its reduce-scatter never run. A forward prefetch makes
the next unit's views inside the current unit's forward, which the user may run
with autograd off (a frozen trunk under ``torch.no_grad()`` before a trained
head). So views are always made with autograd on, whatever the caller's grad
mode, as torch's FSDP does. A forward prefetch inside ``torch.inference_mode()``
also leaves inference mode for the unshard and the views
(``FlatParamHandle.unshard_ahead`` for forward): made there, the unsharded data
would be inference tensors, of which nothing can be an autograd view, and the
prefetched unit's gradient would be lost (torch's FSDP loses it).

[Note: No reference to the original parameters without use_orig_params]
With ``use_orig_params=False`` the original ``nn.Parameter`` objects are dropped
once flattened: holding them would keep their full-size storage alive next to
the flat parameter for the life of the model.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from fsdp._common import HandleTrainingState
from fsdp._dtensor_extensions import DTensorExtensions, ParamExtension, local_of
from fsdp._grads import FlatParamGrads, assign_grad
from fsdp._layout import FlatParamLayout, ParamInfo, ShardLayout
from fsdp._placeholder import ShardedParamPlaceholder
from fsdp._setattr import set_param, set_params, set_tensor, set_tensors
from fsdp._storage import FlatParameter, same_storage


class Written(NamedTuple):
    """What a writeback copied into the flat parameter and its gradient."""

    params: bool
    grads: bool


class ViewMode(enum.Enum):
    """What the original parameter names hold now."""

    RESHARDED = enum.auto()  # shard views (use_orig_params) or placeholders / NO_SHARD views
    UNSHARDED_TENSORS = enum.auto()  # forward and backward: Tensor views of the unsharded data
    KEPT_FORWARD = enum.auto()  # no-reshard strategies: forward's views, until backward
    UNSHARDED_PARAMS = enum.auto()  # summon_full_params, state dicts: Parameter views


def _check_writeback_shape(tensor: Tensor, expected: torch.Size, is_param: bool) -> None:
    if tensor.shape != expected:
        what = "parameter" if is_param else "gradient"
        raise RuntimeError(
            f"Cannot writeback when the {what} shape changes\n"
            f"Expects {expected} but got {tensor.shape}"
        )


class OrigParamViews:
    """The original parameter names of one flat parameter (see the module notes)."""

    layout: FlatParamLayout
    shard: ShardLayout
    use_orig_params: bool
    safe_setattr: bool  # see [Note: Setting the original names] in fsdp._setattr
    params: list[nn.Parameter]  # the original parameters (use_orig_params only)
    mode: ViewMode
    _forward_tensors: list[Tensor | None]  # forward's views, reused in backward
    _kept_home: Tensor | None  # what forward's kept views point into
    _placeholders: list[ShardedParamPlaceholder]
    _grad_none: list[bool]  # the user set this original gradient to None
    _resharded: tuple[Tensor, bool, list[Tensor | None]] | None  # a shard, requires_grad, views
    _shown_ptrs: list[int]  # data pointer of each parameter as last shown (resharded)
    _grad_views: tuple[Tensor, list[Tensor | None]] | None  # a gradient and its views
    _grad_ptrs: list[int]  # data pointer of each parameter's gradient as last shown
    _extensions: tuple[ParamExtension | None, ...]  # see [Note: Tensor-parallel parameters]

    def __init__(
        self,
        layout: FlatParamLayout,
        shard: ShardLayout,
        params: tuple[nn.Parameter, ...],
        use_orig_params: bool,
        safe_setattr: bool,
        extensions: tuple[ParamExtension | None, ...] = (),
    ) -> None:
        self.layout = layout
        self.shard = shard
        self.use_orig_params = use_orig_params
        self.safe_setattr = safe_setattr
        self.params = list(params) if use_orig_params else []
        self.mode = ViewMode.UNSHARDED_PARAMS  # the module's own parameters, until sharded
        self._forward_tensors = [None] * layout.num_params
        self._kept_home = None
        self._placeholders = []
        self._grad_none = [False] * layout.num_params
        self._resharded = None
        self._shown_ptrs = [-1] * layout.num_params
        self._grad_views = None
        self._grad_ptrs = [-1] * layout.num_params
        self._extensions = extensions or (None,) * layout.num_params
        self.refresh_placeholders(params[0].dtype, params[0].device)

    def refresh_placeholders(
        self, dtype: torch.dtype, device: torch.device, requires_grad: bool = True
    ) -> None:
        if not self.use_orig_params:
            self._placeholders = [
                ShardedParamPlaceholder(shape, dtype, device, fqn, requires_grad)
                for shape, fqn in zip(self.layout.shapes, self.layout.fqns)
            ]

    # -- the unsharded data ----------------------------------------------------------------

    @torch.enable_grad()
    def show_unsharded(self, flat: Tensor, as_params: bool, phase: HandleTrainingState) -> None:
        """The names become views of the unsharded flat parameter: ``nn.Parameter``
        s when ``as_params`` (summon_full_params, state dicts), plain ``Tensor``
        views otherwise (forward and backward, so autograd reaches ``flat``).
        In backward, forward's views are shown again when they still view
        ``flat``'s memory (autograd saved them already; only a recomputed forward
        reads the names). Made with autograd on (see [Note: Views are made with
        autograd on])."""
        if (
            phase is HandleTrainingState.BACKWARD_PRE
            and not as_params
            and self._forward_views_fit(flat)
        ):
            self._show_forward_views()
            return
        views = self._unflattened(flat)
        if phase is HandleTrainingState.FORWARD and not as_params:
            self._forward_tensors = list(views)
            self._name_tensors(self.layout.param_infos, views)
        for i, (view, info) in enumerate(zip(views, self.layout.param_infos)):
            if as_params:
                self._set_param_view(i, info, view, flat.requires_grad)
            elif phase is not HandleTrainingState.FORWARD:
                self._set_tensor_view(i, info, view, phase)
        self._alias_shared()
        self.mode = ViewMode.UNSHARDED_PARAMS if as_params else ViewMode.UNSHARDED_TENSORS

    def _unflattened(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's view of ``flat`` as the module sees it: a tensor-parallel
        parameter's as a DTensor (see [Note: Tensor-parallel parameters])."""
        views = self.layout.views(flat)
        if not any(self._extensions):
            return views
        return [DTensorExtensions.unflatten(v, e) for v, e in zip(views, self._extensions)]

    def _set_param_view(self, i: int, info: ParamInfo, view: Tensor, requires_grad: bool) -> None:
        if self.use_orig_params and self._extensions[i] is None:
            param = self.params[i]
            param.data = view
        else:
            param = nn.Parameter(view, requires_grad=requires_grad)
        set_param(info.module, info.param_name, param, self.safe_setattr)

    def _forward_views_fit(self, flat: Tensor) -> bool:
        """Every forward view exists and still views its part of ``flat``."""
        base, size = flat.data_ptr(), flat.element_size()
        plain = not any(self._extensions)
        for tensor, offset in zip(self._forward_tensors, self.layout.offsets):
            if tensor is None:
                return False
            local = tensor if plain else local_of(tensor)
            if local.data_ptr() != base + offset * size:
                return False
        return True

    def _show_forward_views(self) -> None:
        tensors = [t for t in self._forward_tensors if t is not None]
        assert len(tensors) == self.layout.num_params
        self._name_tensors(self.layout.param_infos, tensors)
        self._alias_shared()
        self.mode = ViewMode.UNSHARDED_TENSORS

    def _name_tensors(self, infos: Sequence[ParamInfo], tensors: Sequence[Tensor]) -> None:
        """Shows ``tensors`` under the names of ``infos``."""
        if not self.use_orig_params:
            set_tensors(infos, tensors, self.safe_setattr)
            return
        # Stays listed (in place, so the order of ``named_parameters()`` is kept):
        # forward code may look its parameters up by name.
        for info, tensor in zip(infos, tensors):
            info.module._parameters[info.param_name] = tensor  # type: ignore[assignment]
            object.__setattr__(info.module, info.param_name, tensor)

    def _name_tensor(self, info: ParamInfo, tensor: Tensor) -> None:
        self._name_tensors((info,), (tensor,))

    def _set_tensor_view(
        self, i: int, info: ParamInfo, view: Tensor, phase: HandleTrainingState
    ) -> None:
        tensor = view
        saved = self._forward_tensors[i]
        if phase is HandleTrainingState.FORWARD:
            self._forward_tensors[i] = view
        elif phase is HandleTrainingState.BACKWARD_PRE and saved is not None:
            # keeps forward's autograd graph pointing here (a DTensor's local tensor)
            local_of(saved).data = local_of(view)
            tensor = saved
        self._name_tensor(info, tensor)

    def _alias_shared(self) -> None:
        for info in self.layout.shared_param_infos:
            prim = getattr(info.prim_module, info.prim_param_name)
            if isinstance(prim, nn.Parameter):
                set_param(info.module, info.param_name, prim, self.safe_setattr)
            else:
                set_tensor(info.module, info.param_name, prim, self.safe_setattr)

    def keep_forward_views(self, home: Tensor) -> None:
        """No-reshard strategies: forward's views stay until backward."""
        assert self.use_orig_params
        self._kept_home = home
        self.mode = ViewMode.KEPT_FORWARD

    # -- between uses -----------------------------------------------------------------------

    def show_resharded(self, flat_param: FlatParameter) -> None:
        """``use_orig_params``: each original parameter becomes the view of its part
        of the local shard (``NO_SHARD``: of the whole parameter). Otherwise
        ``NO_SHARD`` shows views of its (never freed) flat parameter, which need
        a gradient when it does (as torch's, views with autograd history), and
        sharded strategies show placeholders that say the same (see [Note:
        Placeholders for sharded parameters] in fsdp._placeholder)."""
        self._kept_home = None
        local_shard: Tensor = flat_param._local_shard
        if not self.shard.sharded:
            self._show_no_shard(flat_param)
        elif self.use_orig_params:
            self._show_shard_views(flat_param)
        else:
            if self._placeholders[0].requires_grad != flat_param.requires_grad:
                self.refresh_placeholders(
                    local_shard.dtype, local_shard.device, flat_param.requires_grad
                )
            set_tensors(self.layout.param_infos, self._placeholders, self.safe_setattr)
            self._alias_shared()
        self.mode = ViewMode.RESHARDED

    def _resharded_views(self, flat_param: FlatParameter) -> list[Tensor | None]:
        """Each parameter's view of the local shard, built once per shard tensor
        (and ``requires_grad``). ``NO_SHARD`` without ``use_orig_params`` views the
        flat parameter itself with autograd, as torch does."""
        local_shard: Tensor = flat_param._local_shard
        requires_grad = flat_param.requires_grad
        cached = self._resharded
        if cached is None or cached[0] is not local_shard or cached[1] != requires_grad:
            if self.shard.sharded:
                views = [self.shard.part_of(i, local_shard) for i in range(self.layout.num_params)]
                if self.use_orig_params:  # a parameter outside this rank's shard is empty
                    views = [local_shard.new_empty(0) if v is None else v for v in views]
            elif not self.use_orig_params:
                with torch.enable_grad():
                    views = list(self.layout.views(flat_param))
            else:
                views = list(self.layout.views(local_shard))
            self._resharded = (local_shard, requires_grad, views)
        return self._resharded[2]

    def _show_no_shard(self, flat_param: FlatParameter) -> None:
        if self.use_orig_params:
            self._show_shard_views(flat_param)
            return
        views = self._resharded_views(flat_param)
        shown = [
            view if extension is None else DTensorExtensions.unflatten(view, extension)
            for view, extension in zip(views, self._extensions)
            if view is not None
        ]
        assert len(shown) == self.layout.num_params
        set_tensors(self.layout.param_infos, shown, self.safe_setattr)
        self._alias_shared()

    def _show_shard_views(self, flat_param: FlatParameter) -> None:
        """Each original parameter views its part of the local shard (``NO_SHARD``:
        of the whole parameter) and is shown under its name."""
        views = self._resharded_views(flat_param)
        pointed = (self._point(i, view) for i, view in enumerate(views))  # lazily, in turn
        set_params(self.layout.param_infos, pointed, self.safe_setattr)
        self._alias_shared()

    def _point(self, i: int, view: Tensor | None) -> nn.Parameter:
        """``params[i].data = view`` unless it already views that memory (an empty
        view has no memory: its dtype and device must match, e.g. after ``.half()``);
        returns ``params[i]``."""
        assert view is not None
        param = self.params[i]
        ptr = view.data_ptr()
        if (
            param.data_ptr() != ptr
            or param.shape != view.shape
            or param.dtype != view.dtype
            or param.device != view.device
        ):
            param.data = view
            ptr = param.data_ptr()
        self._shown_ptrs[i] = ptr
        return param

    def release(self) -> None:
        """Removes every original name from its module (around ``module._apply``)."""
        for info in (*self.layout.param_infos, *self.layout.shared_param_infos):
            info.module._parameters.pop(info.param_name, None)
            info.module.__dict__.pop(info.param_name, None)

    def end_iteration(self) -> None:
        self._forward_tensors = [None] * self.layout.num_params

    # -- gradients ------------------------------------------------------------------------------

    def show_sharded_grads(self, grad: Tensor | None) -> None:
        """Each original gradient becomes the view of its part of the sharded
        gradient, except where the user set it to None since the last backward
        (another optimizer's ``zero_grad(set_to_none=True)``)."""
        views = self._sharded_grad_views(grad)
        for i, param in enumerate(self.params):
            exposed = views is not None and param.requires_grad and not self._grad_none[i]
            wanted = views[i] if exposed else None  # type: ignore[index]
            shown = param.grad
            if shown is not wanted:
                assign_grad(param, wanted)
                shown = param.grad
            self._grad_ptrs[i] = -1 if shown is None else shown.data_ptr()

    def _sharded_grad_views(self, grad: Tensor | None) -> list[Tensor | None] | None:
        if grad is None:
            self._grad_views = None
            return None
        if self._grad_views is None or self._grad_views[0] is not grad:
            views: list[Tensor | None]
            if not self.shard.sharded and grad.shape == (self.layout.total_numel,):
                # one split: the same views as ``part_of``'s, with less Python
                views = list(self.layout.views(grad))
            else:
                views = [self.shard.part_of(i, grad) for i in range(self.layout.num_params)]
            self._grad_views = (grad, views)
        return self._grad_views[1]

    def show_unsharded_grads(self, grad: Tensor | None) -> None:
        """Unsharded gradient views (no_sync, summon_full_params(with_grads))."""
        views = self.layout.views(grad) if grad is not None else None
        for i, param in enumerate(self.params):
            exposed = views is not None and param.requires_grad
            assign_grad(param, views[i] if exposed else None)  # type: ignore[index]

    def fresh_grads(self) -> None:
        """A newly reduced gradient covers every parameter again."""
        self._grad_none = [False] * self.layout.num_params

    def forget_grads(self) -> None:
        """The flat gradient was cleared: the cached views must not keep its
        memory alive (a whole flat gradient per unit through the next forward
        and backward)."""
        self._grad_views = None

    def all_grads_cleared(self) -> bool:
        return all(p.grad is None for p in self.params if p.requires_grad)

    # -- writeback -------------------------------------------------------------------------------

    def writeback(
        self, flat_param: FlatParameter, grads: FlatParamGrads, with_grads: bool = True
    ) -> Written:
        """Copies user changes of original parameters (``.data`` or a new
        Parameter) and, ``with_grads``, of their gradients into the flat
        parameter's shard and gradient (torch writes gradients back at the
        unshard only, not at the lazy initialisation); says what was written
        (see [Note: Cheap between-use bookkeeping] for the fast path)."""
        if self._unchanged(flat_param):
            return Written(False, False)
        params = grads_written = False
        for i, info in enumerate(self.layout.param_infos):
            if self.shard.param_range(i) is None or not hasattr(info.module, info.param_name):
                continue
            params |= self._writeback_param(i, info, flat_param)
            if with_grads and self.mode is not ViewMode.KEPT_FORWARD:
                grads_written |= self._writeback_grad(i, flat_param, grads)
        if grads_written:
            # A user's tensor (or a view whose .data the user replaced) was
            # copied: the next showing builds fresh views of the flat gradient.
            self._grad_views = None
        return Written(params, grads_written)

    def _unchanged(self, flat_param: FlatParameter) -> bool:
        """Every name still holds the parameter last shown, viewing the same memory,
        with the gradient view last shown (or no gradient where none was)."""
        if self.mode is not ViewMode.RESHARDED:
            return False
        flat_grad = flat_param.grad
        if flat_grad is not None and any(self._grad_none):
            return False  # a dropped gradient's part is zeroed at every writeback
        views = (
            self._grad_views[1] if self._grad_views and self._grad_views[0] is flat_grad else None
        )
        # where ``set_param`` put the name (see [Note: Setting the original names] in
        # fsdp._setattr)
        where = "_parameters" if self.safe_setattr else "__dict__"
        for i, (info, param) in enumerate(zip(self.layout.param_infos, self.params)):
            if getattr(info.module, where).get(info.param_name) is not param:
                return False
            if param.data_ptr() != self._shown_ptrs[i]:
                return False
            exposed = views is not None and param.requires_grad and not self._grad_none[i]
            expected = views[i] if exposed else None  # type: ignore[index]
            grad = param.grad
            if grad is not expected and not (grad is None and flat_grad is None):
                return False
            if grad is not None and grad.data_ptr() != self._grad_ptrs[i]:
                return False  # ``.grad.data`` was replaced
        return True

    def _writeback_param(self, i: int, info: ParamInfo, flat_param: FlatParameter) -> bool:
        current = getattr(info.module, info.param_name)
        kept = self.mode is ViewMode.KEPT_FORWARD
        expected = self._forward_tensors[i] if kept else self.params[i]
        home = self._kept_home if kept else flat_param
        changed_variable = current is not expected
        if not changed_variable and home is not None and same_storage(current, home):
            return False
        if kept:
            raise AssertionError(
                "FSDP does not support changing the parameters between forward and backward "
                "for strategies that do not reshard after forward"
            )
        if changed_variable:
            self.params[i] = current
        found = self.shard.param_range(i)
        assert found is not None
        start, numel = found
        source = current if self.shard.sharded else current.reshape(-1)
        _check_writeback_shape(source, torch.Size([numel]), is_param=True)
        with torch.no_grad():
            flat_param._local_shard[start : start + numel].copy_(source.reshape(-1))
        return True

    def _writeback_grad(self, i: int, flat_param: FlatParameter, grads: FlatParamGrads) -> bool:
        param = self.params[i]
        flat_grad = flat_param.grad
        if flat_grad is not None and param.grad is not None and same_storage(param.grad, flat_grad):
            return False
        if flat_grad is not None and grads.sharded() is None:
            return False  # an unsharded gradient accumulating under no_sync
        found = self.shard.param_range(i)
        assert found is not None
        start, numel = found
        if param.grad is None:
            if flat_grad is None or not param.requires_grad:
                return False
            # The user dropped this gradient: zeroed at every writeback until a
            # backward shows it again, as torch's FSDP does (an edit of the summoned
            # gradient written back meanwhile is dropped again)
            flat_grad[start : start + numel].zero_()
            self._grad_none[i] = True
            return True
        self._grad_none[i] = False
        source = param.grad if self.shard.sharded else param.grad.reshape(-1)
        _check_writeback_shape(source, torch.Size([numel]), is_param=False)
        if flat_grad is None:
            flat_grad = torch.zeros_like(flat_param._local_shard, dtype=param.grad.dtype)
            assign_grad(flat_param, flat_grad)
        with torch.no_grad():
            flat_grad[start : start + numel].copy_(param.grad.reshape(-1))
        return True
