"""What a drawn program did so far to its gradients and parameters.

The drawing (fsdptest.conformance.drawing) keeps away from calls where torch's
FSDP has a known defect (``fsdptest.conformance.allowed.UNASKED``). Several of
those defects depend on the program's history: which gradients a backward or a
user left, what a ``no_sync`` backward set aside, whether parameter data was
replaced since the last writeback. ``GradHistory`` holds that history and is
moved only by the methods named after the calls that change it; each field
names the entry that reads it.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GradHistory"]


@dataclasses.dataclass
class GradHistory:
    """The gradient and parameter history of one drawn program."""

    # a backward ran or a user set gradients, and no zero_grad(set_to_none=True) since
    has_grads: bool = False
    # a gradient from outside no_sync (a synced backward's, a user's) is held; a
    # backward under no_sync sets it aside until the next synced one
    # (ZERO_GRAD_KEEPS_GRADIENT_SET_ASIDE_BY_NO_SYNC)
    synced_grads: bool = False
    set_aside: bool = False
    # gradients a user set on some parameters only, and no synced backward since
    # (USER_GRADIENT_HIDDEN_AFTER_A_NONE_WRITEBACK)
    some_grads_set: bool = False
    # gradients a user set, maybe on empty views: no backward or clearing since
    # (INF_NORM_OF_AN_EMPTY_USER_GRADIENT)
    user_grads: bool = False
    # gradients a user set leave some parameters None (no backward since), and an
    # optimizer step with such gradients gave some parameters no state
    # (OPTIM_STATE_OF_SOME_PARAMETERS_OF_A_UNIT)
    grads_partial: bool = False
    optim_partial: bool = False
    # original parameters' data replaced, and no forward or summon since
    # (LOCAL_SAVE_SKIPS_WRITEBACK)
    replaced: bool = False
    # a backward ran: every unit resharded (OFFLOADED_EDITS_BEFORE_FIRST_RESHARD)
    resharded: bool = False
    # a forward ran in eval mode (FULL_PRECISION_EVAL_COPY_KEPT)
    eval_forwarded: bool = False
    # Parameters were replaced by new ones (and a new optimizer built over them),
    # and a forward or summon wrote them back since: a rank whose shard holds no
    # element of a replaced parameter shows a view instead, so the optimizer holds
    # a parameter the model no longer lists on some ranks only, and an optimizer
    # state dict raises KeyError there (both FSDPs) while the other ranks go on
    # into the next collective. No optimizer state dict is saved or loaded then.
    params_replaced: bool = False
    orphans_possible: bool = False

    def eval_forward_ran(self) -> None:
        self.eval_forwarded = True

    def zero_grad(self, set_to_none: bool) -> None:
        if set_to_none:
            self.has_grads = self.synced_grads = self.set_aside = False
            self.user_grads = self.grads_partial = False

    def backward(self, windowed: bool, sharded: bool) -> None:
        """A backward, under ``no_sync`` if ``windowed``; a ``sharded`` unit sets
        aside the gradient a backward under no_sync starts from."""
        self.has_grads = self.resharded = True
        self.set_aside = windowed and (self.set_aside or (self.synced_grads and sharded))
        self.synced_grads = self.synced_grads or not windowed
        self.some_grads_set = self.some_grads_set and windowed
        self.grads_partial = False
        self.user_grads = self.user_grads and windowed

    def set_by_user(self, some: bool) -> None:
        """``p.grad = ...`` on every parameter, or (``some``) on some only."""
        self.has_grads = self.synced_grads = self.user_grads = True
        self.some_grads_set = self.grads_partial = some

    def stepped(self) -> None:
        """An optimizer (or scaler) step."""
        if self.grads_partial:
            self.optim_partial = True
        elif self.has_grads:
            self.optim_partial = False

    def data_replaced(self) -> None:
        self.replaced = True

    def written_back(self) -> None:
        """A forward or summon wrote replaced data back."""
        self.replaced = False
        self.orphans_possible = self.orphans_possible or self.params_replaced

    def params_replaced_by_user(self) -> None:
        self.replaced = self.params_replaced = True
